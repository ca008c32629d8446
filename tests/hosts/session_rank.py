"""One rank of a sync session without engines, run as its own program on an emulated host (``testbed.hosts``):

    python tests/hosts/session_rank.py trainer RANK --address tcp://HOST:PORT --syncs 1,2,3 --engines 1:1,3:2
    python tests/hosts/session_rank.py worker LOCAL --engine E --address tcp://HOST:PORT --syncs 1,2,3

Trainer ranks hold ZeRO-3 partitions of a small Qwen3's tensors and write new values before each sync (the
version's values), as an optimizer step would; each engine's two workers hold a TP-2 vLLM layout. Every rank
prints one JSON line per sync: its version and the bytes it moved by each transport, on workers whether
every element landed; or the error, and on workers whether the storage kept its old values and the link's
status. A rank whose sync failed joins a new handshake before its next sync (the trainer ranks with the
engine count of that sync), as a long-running job would; ``--engines`` changes the trainer's engine count
and ``--rejoin`` makes a worker join the handshake of that sync. The last line is ``{"done": true}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from rollout_sync.geometry.model_maps import trainer_maps, vllm_target_maps
from rollout_sync.shapes import model_tensors
from testbed.expected_storage import extract, local_part
from tests.harness.session_model import CONFIG, TRAINERS, WORKERS, full_tensors, stepped_tensors

TOKEN = "hosts-session-test"


def moved(stats) -> dict[str, int]:
    return {
        "received": sum(stats.bytes_received.values()),
        "sent": sum(stats.bytes_sent.values()),
        "mapped_from": sum(stats.bytes_mapped_from.values()),
        "mapped": sum(stats.bytes_mapped.values()),
        "pulled": sum(stats.bytes_pulled.values()),
        "handed": sum(stats.bytes_handed.values()),
        "delta_base": stats.delta_base,
        "read_s": stats.seconds.get("read"),  # group-free workers: waiting for their reads
    }


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout:g} s")
        time.sleep(0.02)


class Made:
    """A ``TargetStream`` as vLLM's loaded forms are one: a target's storage is made at its first part (NaN)
    and, once its last part has landed, written into the worker's storage (a layer's rebuild); each target
    is made once per sync and closed once."""

    def __init__(self, storage: dict[str, torch.Tensor]) -> None:
        self.storage = storage
        self.open_now: dict[str, torch.Tensor] = {}
        self.opened: list[str] = []
        self.closed: list[str] = []

    def open(self, name: str) -> torch.Tensor:
        assert name not in self.open_now, f"{name} made twice"
        self.opened.append(name)
        made = self.open_now[name] = torch.full_like(self.storage[name], float("nan"))
        return made

    def close(self, name: str) -> None:
        self.closed.append(name)
        self.storage[name].copy_(self.open_now.pop(name))

    def watches(self, name: str) -> bool:
        return False

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.open_now.values())

    def adds_bytes(self, name: str) -> int:
        t = self.storage[name]
        return 0 if name in self.open_now else t.numel() * t.element_size()

    def reserve_bytes(self) -> int:
        return 0

    def room_bytes(self) -> int:
        return max(t.numel() * t.element_size() for t in self.storage.values())

    def check(self) -> None:
        assert not self.open_now, f"left open: {sorted(self.open_now)}"
        assert sorted(self.opened) == sorted(self.closed) == sorted(set(self.opened)), (
            self.opened,
            self.closed,
        )
        assert set(self.closed) == set(self.storage), sorted(set(self.storage) - set(self.closed))


def join_worker(args: argparse.Namespace, maps: list) -> Any:
    """Join the next handshake, as a long-running engine does: the coordinator may not be there yet (its
    trainer still failing, a link still down), so a join that times out is tried again, up to 5 timeouts."""
    from rollout_sync.errors import SyncTimeoutError
    from rollout_sync.rollout.group_link import RolloutLink

    deadline = time.monotonic() + 5 * args.timeout
    while True:
        try:
            return RolloutLink.connect(
                args.address, engine=args.engine, local_rank=args.rank, local_size=WORKERS, maps=maps,
                token=TOKEN, timeout=args.timeout,
                **({"staging_cap_bytes": args.cap} if args.cap else {}),
            )  # fmt: skip
        except SyncTimeoutError:
            if time.monotonic() > deadline:
                raise


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("trainer", "worker"))
    ap.add_argument("rank", type=int)
    ap.add_argument("--address", required=True)
    ap.add_argument("--engine", type=int, default=0, help="a worker's engine")
    ap.add_argument("--syncs", default="1,2", help="the syncs (versions) this rank takes part in")
    ap.add_argument("--engines", default="", help="trainer: engines per sync, 'V:N,...' from sync V on")
    ap.add_argument("--rejoin", default="", help="worker: syncs before which to join a new handshake")
    ap.add_argument("--control", default=None, help="wait for CONTROL/go-V before sync V")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument(
        "--backend", default="gloo", help="trainer: the sync's backend (gloo, or nixl: group-free)"
    )
    ap.add_argument(
        "--stream", action="store_true", help="worker: targets made while written (as vLLM's loaded forms)"
    )
    ap.add_argument("--cap", type=int, default=None, help="worker: its staging cap, bytes")
    ap.add_argument(
        "--delta",
        type=float,
        default=0.0,
        help="every rank: each version changes this share of the elements (session_model.stepped_tensors); "
        "the trainer asks for delta syncs",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = model_tensors(CONFIG)
    sources = trainer_maps(model, 3, TRAINERS)
    syncs = [int(v) for v in args.syncs.split(",")]

    def values(version: int) -> dict[str, torch.Tensor]:
        return stepped_tensors(version, args.delta) if args.delta else full_tensors(version)

    control = Path(args.control) if args.control else None
    me = {"role": args.role, "rank": args.rank, "host": socket.gethostname(), "pid": os.getpid()}

    def report(**fields) -> None:
        print(json.dumps({**me, **fields}), flush=True)

    if args.role == "trainer":
        from rollout_sync.trainer.hook import TrainerSync

        steps = sorted(
            (int(v), int(n)) for v, n in (x.split(":") for x in (args.engines or "1:1").split(","))
        )
        views = {
            m.name: extract(full_tensors(0)[m.name], m, args.rank) for m in sources if args.rank in m.ranks
        }
        side, joined = None, None
        for version in syncs:
            engines = [n for v, n in steps if v <= version][-1]
            if control is not None:
                wait_for(control / f"go-{version}", args.timeout * 3)
            # group-free (nixl): engines join and leave through the admission desk; the trainer never rejoins
            regroup = engines != joined and args.backend != "nixl"
            if side is None or side.endpoint.closed or regroup:
                if side is not None:
                    side.detach()
                side = TrainerSync.connect(
                    sources, views, rank=args.rank, world_size=TRAINERS, address=args.address, engines=engines,
                    token=TOKEN, timeout=args.timeout, backend=args.backend, delta=bool(args.delta),
                )  # fmt: skip
                joined = engines
                report(attached=version)
            full = values(version)
            for m in sources:
                if args.rank in m.ranks:
                    side.sources[m.name].copy_(extract(full[m.name], m, args.rank))
            started = time.monotonic()
            try:
                result = side.sync(version)
            except Exception as exc:
                report(
                    version=version, error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started
                )
                continue
            report(
                version=result.version, seconds=time.monotonic() - started, dropped=list(result.dropped),
                **moved(result.stats),
            )  # fmt: skip
    else:
        first = TRAINERS + args.engine * WORKERS
        targets = vllm_target_maps(model, 1, WORKERS, first_rank=first)
        rank = first + args.rank
        mine = [local_part(m, rank, args.rank) for m in targets if rank in m.ranks]
        storage = {
            m.name: torch.full(m.ranks[rank].shape, float("nan"), dtype=torch.bfloat16)
            for m in targets
            if rank in m.ranks
        }
        rejoin = {int(v) for v in args.rejoin.split(",") if v}
        link = None
        for version in syncs:
            if link is None or link.endpoint.closed or version in rejoin:
                if link is not None:
                    link.endpoint.close()
                report(joining=version)
                link = join_worker(args, mine)  # fmt: skip
                report(joined=version)
            before = {n: t.clone() for n, t in storage.items()}
            started = time.monotonic()
            stream = Made(storage) if args.stream else None
            try:
                if stream is None:
                    result = link.receive(storage)
                else:
                    meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in storage.items()}
                    result = link.receive(meta, stream)
                    stream.check()
            except Exception as exc:
                kept = all(torch.equal(before[n], storage[n]) for n in storage)
                report(
                    version=version, error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started,
                    status=link.status(), unchanged=kept,
                )  # fmt: skip
                continue
            full = values(result.version)
            wrong = [
                m.name
                for m in targets
                if rank in m.ranks and not torch.equal(storage[m.name], extract(full[m.name], m, rank))
            ]
            report(
                version=result.version, wrong=wrong, seconds=time.monotonic() - started, **moved(result.stats)
            )
    report(done=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every line is out: end here, not in the interpreter's teardown, where a library thread left behind by a
    # closed gloo group once aborted a finished rank (SIGABRT, "terminate called without an active exception").
    os._exit(code)
