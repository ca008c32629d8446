"""Executor benchmark: ours against the usual gather-and-broadcast sync and against raw point-to-point, in
one run, on the same CPU ranks and the same weights.

``python -m benchmarks execute [--json] [--layers 6] [--vocab 32768] [--syncs 7] [--warmup 1]
[--cap-mib 64] [--no-zero-copy]``

Four processes over one gloo group (``rollout_sync.transport.core.groups``): trainer ranks 0-1 hold a Qwen3-like
model (hidden 1024, 16 heads, 8 kv heads, head dim 128, intermediate 3072; ``--layers`` layers, ``--vocab``
rows, untied lm_head; bf16) as DeepSpeed ZeRO-3 partitions; rollout ranks 2-3 hold it as one vLLM TP-2
engine (fused qkv / gate_up rows, o_proj / down_proj columns, vocab-parallel embedding and lm_head, norms
replicated). Maps from ``rollout_sync.shapes`` (``trainer_maps``, ``vllm_target_maps``), plan from
``plan_model``. Every storage is a view into one flat buffer per rank, as in the engines.

- ``ours``: ``Executor.execute`` of each rank's half (staging cap ``--cap-mib``), one executor reused.
- ``baseline`` (OpenRLHF / DeepSpeed-Chat style): for each logical tensor in turn, the trainer ranks
  allgather the ZeRO-3 partitions into the full tensor (a fresh padded buffer, as ``GatheredParameters``
  does), trainer rank 0 broadcasts it to every rollout rank (group {0, 2, 3}; each receives into a fresh
  full-size buffer), and each rollout rank copies its shard out (the weight loader's narrow + copy).
- ``ceiling``: the bytes ours moves between each pair of ranks, as one preallocated packed buffer per
  pair, sent with raw ``send``/``recv``: transport only, no planning, no packing, no copies.
- ``ours_same_host``: ours with the same-host transport (every rank knows the others run on this host):
  each receiver maps its senders' storages and copies its segments straight from them (``transport.mapped``;
  small tables and "done" over gloo). ``ours`` above is the gloo path (no rank knows where the others run).
- ``memcpy_bound``: one copy of the bytes each rank receives (``bytes_received`` of ours), preallocated
  buffer to buffer, on every rank at once: what moving those bytes through memory costs at the least.

A sync's time is the slowest rank's, from a common barrier to that rank's return. Each method runs
``--warmup`` unmeasured syncs, then ``--syncs`` measured ones, the three methods interleaved; the median is
reported. The first sync of ``ours`` and of ``baseline`` is checked element by element against the
logical values (targets poisoned with NaN first). The last line with ``--json`` is one JSON object:
``ours_s, baseline_s, ceiling_s, bytes, rounds, peak_staging_bytes, staging_cap_bytes,
baseline_peak_extra_bytes, ours_same_host_s, memcpy_bound_s``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

METHODS = ("ours", "ours_same_host", "baseline", "ceiling", "memcpy_bound")
TRAINER = (0, 1)
ROLLOUT = (2, 3)
WORLD = 4


def qwen3_like(layers: int, vocab: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "num_hidden_layers": layers,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def _maps(layers: int, vocab: int) -> tuple[list[Any], list[Any]]:
    from rollout_sync.geometry import trainer_maps, vllm_target_maps
    from rollout_sync.shapes import model_tensors

    model = model_tensors(qwen3_like(layers, vocab))
    sources = trainer_maps(model, zero_stage=3, dp=len(TRAINER), dtype="bfloat16")
    targets = vllm_target_maps(model, engines=1, tp=len(ROLLOUT), first_rank=ROLLOUT[0], dtype="bfloat16")
    return sources, targets


def _logical(name_index: int, shape: tuple[int, ...], device: Any = "cpu") -> Any:
    """Logical tensor values, cheap and distinct enough to catch a misplaced element (bf16)."""
    import torch

    n = 1
    for e in shape:
        n *= e
    k = torch.arange(n, dtype=torch.int64, device=device)
    return (
        (((k * 7919 + name_index * 104729) % 10007).to(torch.float32) / 64 - 78)
        .to(torch.bfloat16)
        .view(shape)
    )


def _carve(
    shapes: dict[str, tuple[int, ...]], dtype: Any, fill: float, device: Any = "cpu"
) -> tuple[Any, dict[str, Any]]:
    """One flat buffer (on ``device``) and a contiguous view of it per name (64-element aligned)."""
    import torch

    sizes = {}
    total = 0
    for name, shape in shapes.items():
        n = 1
        for e in shape:
            n *= e
        sizes[name] = (total, n)
        total += -(-n // 64) * 64
    flat = torch.full((total,), fill, dtype=dtype, device=device)
    return flat, {name: flat[a : a + n].view(shapes[name]) for name, (a, n) in sizes.items()}


def _pieces_copy(storage: Any, storage_map: Any, full: Any, into_storage: bool) -> None:
    import torch

    for p in storage_map.pieces:
        view = torch.as_strided(storage, p.box.extent, p.strides, storage.storage_offset() + p.offset)
        box = tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))
        if into_storage:
            view.copy_(full[box])
        else:
            full[box].copy_(view)


class TimedRank:
    """One of ``WORLD`` benchmark processes over the gloo group ``self.group``: a barrier, the slowest
    rank's seconds, and a timed call (from a common barrier to the slowest rank's return)."""

    group: Any

    def barrier(self) -> None:
        import torch

        out = [torch.zeros(1) for _ in range(WORLD)]
        self.group.allgather([out], [torch.zeros(1)]).wait(timedelta(seconds=600))

    def slowest(self, seconds: float) -> float:
        import torch

        out = [torch.zeros(1, dtype=torch.float64) for _ in range(WORLD)]
        self.group.allgather([out], [torch.tensor([seconds], dtype=torch.float64)]).wait(
            timedelta(seconds=600)
        )
        return max(float(t) for t in out)

    def timed(self, fn: Any) -> float:
        self.barrier()
        start = time.perf_counter()
        fn()
        return self.slowest(time.perf_counter() - start)

    def interleaved(self, methods: tuple[str, ...], warmup: int, syncs: int) -> dict[str, list[float]]:
        """``warmup`` + ``syncs`` rounds of every method (``self.<name>``) in turn; the measured seconds."""
        times: dict[str, list[float]] = {name: [] for name in methods}
        for i in range(warmup + syncs):
            for name in methods:
                t = self.timed(getattr(self, name))
                if i >= warmup:
                    times[name].append(t)
        return times


class _Rank(TimedRank):
    def __init__(self, rank: int, port: int, args: argparse.Namespace) -> None:
        import torch

        from rollout_sync.planning.planner import plan_model
        from rollout_sync.transport.core.groups import connect_store, new_group

        torch.set_num_threads(1)
        self.rank = rank
        self.args = args
        timeout = 600.0
        store = connect_store("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
        self.group = new_group(store, rank, WORLD, timeout=timeout, prefix="sync")
        self.trainer_group = (
            new_group(store, TRAINER.index(rank), len(TRAINER), timeout=timeout, prefix="trainer")
            if rank in TRAINER
            else None
        )
        bcast = (TRAINER[0], *ROLLOUT)
        self.bcast_group = (
            new_group(store, bcast.index(rank), len(bcast), timeout=timeout, prefix="bcast")
            if rank in bcast
            else None
        )
        self.source_maps, self.target_maps = _maps(args.layers, args.vocab)
        self.plan = plan_model(self.source_maps, self.target_maps)
        self.half = self.plan.half(rank)
        src_shapes = {m.name: m.ranks[rank].shape for m in self.source_maps if rank in m.ranks}
        tgt_shapes = {m.name: m.ranks[rank].shape for m in self.target_maps if rank in m.ranks}
        self.src_flat, self.sources = _carve(src_shapes, torch.bfloat16, -1.0)
        self.tgt_flat, self.targets = _carve(tgt_shapes, torch.bfloat16, float("nan"))
        for i, m in enumerate(self.source_maps):
            if rank in m.ranks:
                _pieces_copy(self.sources[m.name], m.ranks[rank], _logical(i, m.shape), True)

    # -- helpers ---------------------------------------------------------------------------------------
    def verify(self) -> bool:
        import torch

        ok = True
        for i, m in enumerate(self.target_maps):
            if self.rank in m.ranks:
                full = _logical(i, m.shape)
                expected = torch.full(m.ranks[self.rank].shape, float("nan"), dtype=torch.bfloat16)
                _pieces_copy(expected, m.ranks[self.rank], full, True)
                ok &= torch.equal(expected.view(torch.int16), self.targets[m.name].view(torch.int16))
        return bool(self.slowest(0.0 if ok else 1.0) == 0.0)

    # -- the three methods -----------------------------------------------------------------------------
    def ours(self) -> None:
        self.last = self.executor.execute(self.half, self.sources, self.targets)

    def ours_same_host(self) -> None:
        self.last_same_host = self.same_host_executor.execute(self.half, self.sources, self.targets)

    def memcpy_bound(self) -> None:
        self.copy_dst.copy_(self.copy_src)

    def baseline(self) -> None:
        import torch

        rank = self.rank
        timeout = timedelta(seconds=600)
        peak = 0
        source_of = {m.name: m for m in self.source_maps}
        for m_tgt in self.target_maps:
            m_src = source_of[m_tgt.name]
            numel = m_src.numel
            full = None
            if rank in TRAINER and self.trainer_group is not None:
                part = self.sources[m_src.name].view(-1)
                per = -(-numel // len(TRAINER))  # ZeRO-3 partition size (last one padded)
                padded = torch.zeros(per, dtype=torch.bfloat16)
                padded[: part.numel()].copy_(part)
                gathered = torch.empty(per * len(TRAINER), dtype=torch.bfloat16)
                chunks = list(gathered.split(per))
                self.trainer_group.allgather([chunks], [padded]).wait(timeout)
                full = gathered[:numel].view(m_src.shape)
                peak = max(peak, gathered.numel() * 2 + per * 2)
            if self.bcast_group is not None:
                if full is None:
                    full = torch.empty(m_src.shape, dtype=torch.bfloat16)
                    peak = max(peak, full.numel() * 2)
                self.bcast_group.broadcast(full, 0).wait(timeout)
                if rank in ROLLOUT:
                    _pieces_copy(self.targets[m_tgt.name], m_tgt.ranks[rank], full, True)
        self.baseline_peak = peak

    def ceiling(self) -> None:
        timeout = timedelta(seconds=600)
        works = [self.group.recv([buf], peer, 0) for peer, buf in self.raw_recv.items()]
        works += [self.group.send([buf], peer, 0) for peer, buf in self.raw_send.items()]
        for w in works:
            w.wait(timeout)

    def run(self) -> dict[str, Any]:
        import torch

        from rollout_sync.transport import ExecuteOptions, Executor
        from rollout_sync.transport.same_host.shared_memory import SameHost

        options = ExecuteOptions(
            staging_cap_bytes=self.args.cap_mib << 20, timeout=600, zero_copy=not self.args.no_zero_copy
        )
        self.executor = Executor(self.group, options)
        pids = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
        self.group.allgather([pids], [torch.tensor([os.getpid()])]).wait(timedelta(seconds=600))
        peers = {r: int(p) for r, p in enumerate(pids) if r != self.rank}
        self.same_host_executor = Executor(
            self.group, options, same_host=SameHost(self.args.group_id, self.rank, peers)
        )
        # first syncs are checked
        self.tgt_flat.fill_(float("nan"))
        first = self.timed(self.ours)
        ours_ok = self.verify()
        stats = self.last
        self.tgt_flat.fill_(float("nan"))
        self.timed(self.ours_same_host)
        same_host_ok = self.verify()
        received = sum(stats.bytes_received.values())
        self.copy_src = torch.ones(received, dtype=torch.uint8)
        self.copy_dst = torch.zeros(received, dtype=torch.uint8)
        self.tgt_flat.fill_(float("nan"))
        self.timed(self.baseline)
        baseline_ok = self.verify()
        # the ceiling moves exactly the bytes ours moved between each pair
        self.raw_send = {p: torch.empty(n, dtype=torch.uint8) for p, n in stats.bytes_sent.items()}
        self.raw_recv = {p: torch.empty(n, dtype=torch.uint8) for p, n in stats.bytes_received.items()}
        times = self.interleaved(METHODS, self.args.warmup, self.args.syncs)
        stats = self.last
        self.same_host_executor.close()
        return {
            "rank": self.rank,
            "first_ours_s": first,
            "verified": ours_ok and baseline_ok and same_host_ok,
            "same_host_stats": self.last_same_host.to_dict(),
            "times": times,
            "stats": stats.to_dict(),
            "baseline_peak": self.baseline_peak,
            "plan_segments": len(self.plan),
            "model_bytes": sum(m.numel * 2 for m in self.source_maps),
        }


def _child(rank_class: Any, rank: int, port: int, args: argparse.Namespace, conn: Connection) -> None:
    try:
        result = rank_class(rank, port, args).run()
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    conn.close()


def spawn_ranks(args: argparse.Namespace, rank_class: Any = None) -> list[dict[str, Any]]:
    """Run ``rank_class(rank, port, args).run()`` in ``WORLD`` spawned processes that share one TCP store
    (default: this benchmark's ranks); their results in rank order, or the first failure with its
    traceback. ``args.timeout`` bounds the whole run."""
    rank_class = _Rank if rank_class is None else rank_class
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, WORLD, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs, readers = [], []
    try:
        for rank in range(WORLD):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(rank_class, rank, store.port, args, writer), daemon=True)
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        results: list[Any] = [None] * WORLD
        deadline = time.monotonic() + args.timeout
        pending = dict(zip(readers, range(WORLD), strict=True))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(pending.values())} did not finish within {args.timeout} s")
            ready = wait(list(pending), timeout=left)
            for conn in [c for c in pending if c in ready]:
                rank = pending.pop(conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    raise RuntimeError(f"rank {rank} died without reporting") from None
                if kind != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks execute", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the Qwen3-like model")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary rows")
    parser.add_argument("--syncs", type=int, default=7, help="measured syncs per method (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured syncs per method first")
    parser.add_argument("--cap-mib", type=int, default=64, help="staging cap per rank, MiB")
    parser.add_argument(
        "--no-zero-copy",
        action="store_true",
        help="stage every segment (no direct storage-to-storage messages)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the run is abandoned")
    args = parser.parse_args(argv)
    args.group_id = secrets.token_hex(6)  # names the same-host run's shared segments
    results = spawn_ranks(args)
    r0 = results[0]
    med = {name: statistics.median(r0["times"][name]) for name in METHODS}
    wire = sum(sum(r["stats"]["bytes_sent"].values()) for r in results)
    local = sum(r["stats"]["local_bytes"] for r in results)
    out = {
        "ours_s": med["ours"],
        "baseline_s": med["baseline"],
        "ceiling_s": med["ceiling"],
        "bytes": wire + local,
        "rounds": max(r["stats"]["rounds"] for r in results),
        "peak_staging_bytes": max(r["stats"]["peak_staging_bytes"] for r in results),
        "staging_cap_bytes": r0["stats"]["staging_cap_bytes"],
        "baseline_peak_extra_bytes": max(r["baseline_peak"] for r in results),
        "ours_same_host_s": med["ours_same_host"],
        "memcpy_bound_s": med["memcpy_bound"],
        "same_host_peak_staging_bytes": max(r["same_host_stats"]["peak_staging_bytes"] for r in results),
    }
    print(
        f"model {r0['model_bytes'] / 2**20:.1f} MiB bf16, plan {r0['plan_segments']} segments, "
        f"{args.syncs} syncs after {args.warmup} warm-up, verified={all(r['verified'] for r in results)}"
    )
    for name in METHODS:
        runs = ", ".join(f"{t:.3f}" for t in r0["times"][name])
        print(f"{name:>8}: median {med[name]:.3f} s  [{runs}]")
    paired = statistics.median(
        o / c for o, c in zip(r0["times"]["ours"], r0["times"]["ceiling"], strict=True)
    )
    print(
        f"baseline / ours {med['baseline'] / med['ours']:.2f}x, ours / ceiling {med['ours'] / med['ceiling']:.2f}x "
        f"(median of per-iteration ratios {paired:.2f}x), first ours sync {r0['first_ours_s']:.3f} s"
    )
    print(
        f"same host: ours_same_host / memcpy_bound {med['ours_same_host'] / med['memcpy_bound']:.2f}x, "
        f"gloo path / same host {med['ours'] / med['ours_same_host']:.2f}x"
    )
    for r in results:
        s = r["same_host_stats"]
        phases = ", ".join(f"{k} {v * 1000:.1f}" for k, v in s["seconds"].items())
        print(f"same host rank {r['rank']}: staging {s['peak_staging_bytes']} B; ms: {phases}")
    for r in results:
        s = r["stats"]
        phases = ", ".join(f"{k} {v * 1000:.1f}" for k, v in s["seconds"].items())
        print(
            f"rank {r['rank']}: sent {s['bytes_sent']} received {s['bytes_received']} rounds {s['rounds']} "
            f"messages {s['messages_sent']}/{s['messages_received']} staging {s['peak_staging_bytes']} B; ms: {phases}"
        )
    if not all(r["verified"] for r in results):
        print("ERROR: a target storage did not match the logical values", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0
