"""Same-device benchmark and check: ours through mapped handoffs (CUDA IPC on a GPU) against one
device-to-device copy of the same bytes, in one run, checked bit for bit. ``scripts/gpu_check.sh`` runs it.

``python -m benchmarks ipc [--device cuda|cpu] [--layers 28] [--vocab 151936] [--syncs 5]
[--warmup 1] [--json]``

Four processes on one device (``--device cuda``: GPU 0, shared by all four, as a trainer and a colocated
vLLM engine share one; ``cpu``: the same run through memory files, to check the script without a GPU),
over one gloo group that carries only small tables and "done" signals (NCCL cannot put two ranks on one
GPU): trainer ranks 0-1 hold a Qwen3-like model (hidden 1024, 16 heads, 8 kv heads, head dim 128,
intermediate 3072, ``--layers`` layers, ``--vocab`` rows, untied lm_head; bf16; the defaults are
Qwen3-0.6B's shapes, about 1.5 GB) as DeepSpeed ZeRO-3 flat partitions; rollout ranks 2-3 hold it as one
vLLM TP-2 engine (fused qkv / gate_up rows, o_proj / down_proj columns, vocab-parallel embedding and
lm_head). Maps from ``rollout_sync.shapes``, plan from ``plan_model``, as ``bench execute``.

- ``ours_ipc``: ``Executor.execute`` of each rank's half with the same-host transport
  (``ExecuteOptions.shared_memory``). The probe opens each peer's handle and reads a value through it; every
  pair then maps (a pair that does not is refused with ``BackendDeviceError``): each receiver copies its
  segments device to device straight from its senders' storages (``transport.mapped``, ``cuda_ipc``).
- ``copy_bound``: one device-to-device copy of the bytes each receiver receives, preallocated buffer to
  buffer, on both receivers at once.

The first sync (handles opened) and one more after the measured ones (handles kept) write into targets
poisoned with NaN and are compared, element by element on the device, with the logical values. A sync's
time is the slowest rank's, from a common barrier to that rank's return (a receiver returns after its
stream is synchronized). With ``--json`` the last line is one JSON object: ``device, bytes, ours_ipc_s,
copy_bound_s, ours_gbps, copy_gbps, fraction_of_copy, verified, first_sync_s, ours_copy_phase_s, mapped,
shm_left`` (``bytes``: received by the rollout ranks in one sync; GB/s of those bytes; ``fraction_of_copy``:
``copy_bound_s / ours_ipc_s``; ``ours_copy_phase_s``: the slower receiver's median copy phase, the sync
without its agreement and signals; ``mapped``: every pair mapped; ``shm_left``: entries this run's group left in
``/dev/shm``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
from datetime import timedelta
from typing import Any

from .execute import ROLLOUT, TRAINER, WORLD, TimedRank, _carve, _logical, _maps, _pieces_copy, spawn_ranks

METHODS = ("ours_ipc", "copy_bound")


class _Rank(TimedRank):
    def __init__(self, rank: int, port: int, args: argparse.Namespace) -> None:
        import torch

        from rollout_sync.planning.planner import plan_model
        from rollout_sync.transport.core.groups import connect_store, new_group

        torch.set_num_threads(1)
        self.rank = rank
        self.args = args
        if args.device == "cuda":
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        store = connect_store("127.0.0.1", port, WORLD, is_master=False, timeout=args.timeout)
        self.group = new_group(store, rank, WORLD, timeout=args.timeout, prefix="sync")
        self.source_maps, self.target_maps = _maps(args.layers, args.vocab)
        self.plan = plan_model(self.source_maps, self.target_maps)
        self.half = self.plan.half(rank)
        src_shapes = {m.name: m.ranks[rank].shape for m in self.source_maps if rank in m.ranks}
        tgt_shapes = {m.name: m.ranks[rank].shape for m in self.target_maps if rank in m.ranks}
        self.src_flat, self.sources = _carve(src_shapes, torch.bfloat16, -1.0, self.device)
        self.tgt_flat, self.targets = _carve(tgt_shapes, torch.bfloat16, float("nan"), self.device)
        for i, m in enumerate(self.source_maps):
            if rank in m.ranks:
                _pieces_copy(self.sources[m.name], m.ranks[rank], _logical(i, m.shape, self.device), True)
        self._sync()

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def verify(self) -> bool:
        import torch

        ok = True
        for i, m in enumerate(self.target_maps):
            if self.rank in m.ranks:
                full = _logical(i, m.shape, self.device)
                expected = torch.full(
                    m.ranks[self.rank].shape, float("nan"), dtype=torch.bfloat16, device=self.device
                )
                _pieces_copy(expected, m.ranks[self.rank], full, True)
                ok &= torch.equal(expected.view(torch.int16), self.targets[m.name].view(torch.int16))
        return bool(self.slowest(0.0 if ok else 1.0) == 0.0)

    def ours_ipc(self) -> None:
        self.last = self.executor.execute(self.half, self.sources, self.targets)
        self.copy_phases.append(float(self.last.seconds.get("local", 0.0)))

    def copy_bound(self) -> None:
        self.copy_dst.copy_(self.copy_src)
        self._sync()

    def run(self) -> dict[str, Any]:
        import torch

        from rollout_sync.transport import ExecuteOptions, Executor
        from rollout_sync.transport.same_host.shared_memory import SameHost

        options = ExecuteOptions(
            staging_cap_bytes=self.args.cap_mib << 20, timeout=self.args.timeout, shared_memory=True
        )
        pids = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
        self.group.allgather([pids], [torch.tensor([os.getpid()])]).wait(timedelta(seconds=self.args.timeout))
        peers = {r: int(p) for r, p in enumerate(pids) if r != self.rank}
        self.executor = Executor(
            self.group, options, same_host=SameHost(self.args.group_id, self.rank, peers)
        )
        self.copy_phases: list[float] = []
        self.tgt_flat.fill_(float("nan"))
        self._sync()
        first = self.timed(self.ours_ipc)
        first_ok = self.verify()
        stats = self.last.to_dict()
        mapped_from = {int(p): int(n) for p, n in stats["bytes_mapped_from"].items()}
        received = sum(mapped_from.values())
        messages = sum(int(n) for n in stats["bytes_received"].values()) + sum(
            int(n) for n in stats["bytes_sent"].values()
        )
        self.copy_src = torch.ones(max(received, 1), dtype=torch.uint8, device=self.device)
        self.copy_dst = torch.zeros(max(received, 1), dtype=torch.uint8, device=self.device)
        times = self.interleaved(METHODS, self.args.warmup, self.args.syncs)
        measured = self.copy_phases[1 + self.args.warmup :]
        self.tgt_flat.fill_(float("nan"))
        self._sync()
        self.timed(self.ours_ipc)
        last_ok = self.verify()
        self.executor.close()
        return {
            "rank": self.rank,
            "first_s": first,
            "verified": first_ok and last_ok,
            "times": times,
            "received": received,
            "copy_phase_s": statistics.median(measured) if measured else 0.0,
            "message_bytes": messages,
            "stats": self.last.to_dict(),
            "model_bytes": sum(m.numel * 2 for m in self.source_maps),
        }


def _shm_entries(group_id: str) -> set[str]:
    """This run's entries in ``/dev/shm``: shared segments are named after their group (``SHM_PREFIX``, pid,
    group id); other processes' entries (a test run beside this one) are not this run's."""
    try:
        return {e for e in os.listdir("/dev/shm") if group_id in e}
    except OSError:
        return set()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ipc", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-like model")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary rows")
    parser.add_argument("--syncs", type=int, default=5, help="measured syncs per method (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured syncs per method first")
    parser.add_argument("--cap-mib", type=int, default=64, help="staging cap per rank, MiB")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before the run is abandoned")
    args = parser.parse_args(argv)
    args.group_id = secrets.token_hex(6)
    results = spawn_ranks(args, _Rank)
    left = sorted(_shm_entries(args.group_id))
    r0 = results[0]
    med = {name: statistics.median(r0["times"][name]) for name in METHODS}
    received = sum(results[r]["received"] for r in ROLLOUT)
    mapped = all(r["message_bytes"] == 0 for r in results) and received > 0
    out = {
        "device": args.device,
        "bytes": received,
        "ours_ipc_s": med["ours_ipc"],
        "copy_bound_s": med["copy_bound"],
        "ours_gbps": received / med["ours_ipc"] / 1e9,
        "copy_gbps": received / med["copy_bound"] / 1e9,
        "fraction_of_copy": med["copy_bound"] / med["ours_ipc"],
        "verified": all(r["verified"] for r in results),
        "first_sync_s": r0["first_s"],
        "ours_copy_phase_s": max(results[r]["copy_phase_s"] for r in ROLLOUT),
        "mapped": mapped,
        "shm_left": left,
    }
    print(
        f"model {r0['model_bytes'] / 2**20:.1f} MiB bf16 on {args.device}, trainer ranks {TRAINER} (ZeRO-3) to "
        f"rollout ranks {ROLLOUT} (TP 2); {received / 2**20:.1f} MiB received per sync; {args.syncs} syncs "
        f"after {args.warmup} warm-up; verified={out['verified']} (first sync and one with kept handles)"
    )
    for name in METHODS:
        runs = ", ".join(f"{t:.4f}" for t in r0["times"][name])
        print(f"{name:>10}: median {med[name]:.4f} s  [{runs}]")
    print(
        f"ours {out['ours_gbps']:.1f} GB/s against a copy's {out['copy_gbps']:.1f} GB/s: "
        f"{out['fraction_of_copy']:.0%} of it (the receivers' copy phase alone {out['ours_copy_phase_s']:.4f} s: "
        f"{med['copy_bound'] / max(out['ours_copy_phase_s'], 1e-9):.0%}); first sync (handles opened) {out['first_sync_s']:.4f} s; "
        f"every pair mapped: {mapped}; left in /dev/shm: {left or 'nothing'}"
    )
    for r in results:
        s = r["stats"]
        ms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s["seconds"].items())
        print(
            f"rank {r['rank']}: mapped from {s['bytes_mapped_from']}, messages {r['message_bytes']} B; ms: {ms}"
        )
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0 if out["verified"] and mapped and not left else 1
