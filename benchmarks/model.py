"""Model benchmark: the sync time model (``scale.sync_model``) against real syncs, with the link figures it
needs measured in the same run.

``python -m benchmarks model [--json] [--layers 6] [--vocab 32768] [--syncs 5] [--warmup 1]``

Four processes over one gloo group on this host (trainer ranks 0-1, rollout ranks 2-3), the execute
benchmark's Qwen3-like model (``bench.execute.qwen3_like``, bf16). Rows, one layout each, all on the same
processes:

- ``zero3-tp2``: ZeRO-3 over the 2 trainer ranks into one vLLM-like TP-2 engine (the execute benchmark's
  layout), staging cap 64 MiB;
- ``zero3-tp2-cap4``: the same with a 4 MiB staging cap (many packed rounds and messages);
- ``zero2-tp2``: ZeRO-2 (both trainer ranks hold the whole model), balanced replica policy;
- ``zero3-2x-tp1``: ZeRO-3 into two engines of one worker each (every worker receives the whole model).

Link figures, measured first with raw gloo ``send``/``recv`` and copies between the same processes:
``message_s`` (half a round trip of an 8-byte message between ranks 0 and 2), ``stream_gbps[k]`` (the
aggregate rate of ``k`` = 1, 2, 4 concurrent 64 MiB streams between trainer and rollout ranks),
``copy_gbps`` (one rank's memcpy rate while all four copy at once), ``agree_s`` (one small allgather).

Per row: ``measured_s``, the median over ``--syncs`` syncs of the slowest rank's ``Executor.execute`` (after
``--warmup``; the first sync is verified element by element), and ``modeled_s``, the model on the
executor's own schedules of that sync, with ``ratio = modeled_s / measured_s``. The last line with
``--json``: ``{"links": {...}, "rows": [{"layout", "measured_s", "modeled_s", "ratio", "bytes", "rounds",
"messages", "parts"}, ...]}``.

Measured (2026-12-02, 2-core AMD EPYC, AVX2, default sizes: 308-616 MiB per sync): ratios 0.88-1.16 on the
four rows over two runs (docs/measurements/bench-model-2026-12-02.txt). At small sizes the model
underestimates: with ``--layers 1 --vocab 4096`` (46 MiB) it gave 0.64-0.76, the fixed costs of a sync that
it does not count (checks, posting, per-segment work in Python) weighing more there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from rollout_sync.scale.sync_model import LinkFigures, modeled_sync, rank_work

from .execute import TimedRank, _carve, _logical, _pieces_copy, qwen3_like, spawn_ranks

__all__ = ["main"]

WORLD = 4
TRAINER = (0, 1)
ROLLOUT = (2, 3)
ROWS: dict[str, dict[str, Any]] = {
    "zero3-tp2": {"zero": 3, "engines": 1, "tp": 2, "cap_mib": 64, "policy": "lowest"},
    "zero3-tp2-cap4": {"zero": 3, "engines": 1, "tp": 2, "cap_mib": 4, "policy": "lowest"},
    "zero2-tp2": {"zero": 2, "engines": 1, "tp": 2, "cap_mib": 64, "policy": "balanced"},
    "zero3-2x-tp1": {"zero": 3, "engines": 2, "tp": 1, "cap_mib": 64, "policy": "lowest"},
}
STREAM_BYTES = 64 << 20
TIMEOUT = timedelta(seconds=600)


class _Rank(TimedRank):
    def __init__(self, rank: int, port: int, args: argparse.Namespace) -> None:
        import torch

        from rollout_sync.transport.core.groups import connect_store, new_group

        torch.set_num_threads(1)
        self.rank = rank
        self.args = args
        store = connect_store("127.0.0.1", port, WORLD, is_master=False, timeout=600)
        self.group = new_group(store, rank, WORLD, timeout=600, prefix="model")

    # -- link figures ------------------------------------------------------------------------------------
    def _streams(self, pairs: list[tuple[int, int]], buffers: dict[tuple[int, int], Any]) -> None:
        works = []
        for src, dst in pairs:
            if self.rank == src:
                works.append(self.group.send([buffers[(src, dst)]], dst, 7))
            if self.rank == dst:
                works.append(self.group.recv([buffers[(src, dst)]], src, 7))
        for w in works:
            w.wait(TIMEOUT)

    def links(self) -> LinkFigures:
        import torch

        repeat = 5
        # per message: half a round trip of 8 bytes between ranks 0 and 2
        buf = torch.zeros(1, dtype=torch.int64)
        trips = 200

        def ping() -> None:
            for _ in range(trips):
                if self.rank == 0:
                    self.group.send([buf], 2, 3).wait(TIMEOUT)
                    self.group.recv([buf], 2, 4).wait(TIMEOUT)
                elif self.rank == 2:
                    self.group.recv([buf], 0, 3).wait(TIMEOUT)
                    self.group.send([buf], 0, 4).wait(TIMEOUT)

        message_s = statistics.median(self.timed(ping) for _ in range(repeat)) / trips / 2
        patterns = {1: [(0, 2)], 2: [(0, 2), (1, 3)], 4: [(0, 2), (0, 3), (1, 2), (1, 3)]}
        buffers = {
            pair: torch.ones(STREAM_BYTES, dtype=torch.uint8) for pair in patterns[4] if self.rank in pair
        }
        stream_gbps = {}
        for k, pairs in patterns.items():
            self._streams(pairs, buffers)  # warm-up: connections, pages
            seconds = statistics.median(
                self.timed(lambda p=pairs: self._streams(p, buffers)) for _ in range(repeat)
            )
            stream_gbps[k] = k * STREAM_BYTES / seconds / 1e9
        src = torch.ones(STREAM_BYTES, dtype=torch.uint8)
        dst = torch.ones(STREAM_BYTES, dtype=torch.uint8)
        copy_s = statistics.median(self.timed(lambda: dst.copy_(src)) for _ in range(repeat))
        agree = torch.zeros(64, dtype=torch.uint8)
        gathered = [torch.zeros(64, dtype=torch.uint8) for _ in range(WORLD)]
        agree_s = statistics.median(
            self.timed(lambda: self.group.allgather([gathered], [agree]).wait(TIMEOUT)) for _ in range(20)
        )
        return LinkFigures(message_s, stream_gbps, STREAM_BYTES / copy_s / 1e9, agree_s)

    # -- rows --------------------------------------------------------------------------------------------
    def row(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        import torch

        from rollout_sync.geometry import trainer_maps, vllm_target_maps
        from rollout_sync.planning.planner import plan_model
        from rollout_sync.shapes import model_tensors
        from rollout_sync.transport import ExecuteOptions, Executor

        model = model_tensors(qwen3_like(self.args.layers, self.args.vocab))
        sources = trainer_maps(model, zero_stage=spec["zero"], dp=len(TRAINER), dtype="bfloat16")
        targets = vllm_target_maps(model, engines=spec["engines"], tp=spec["tp"], first_rank=ROLLOUT[0])
        plan = plan_model(sources, targets, spec["policy"])
        half = plan.half(self.rank)
        src_shapes = {m.name: m.ranks[self.rank].shape for m in sources if self.rank in m.ranks}
        tgt_shapes = {m.name: m.ranks[self.rank].shape for m in targets if self.rank in m.ranks}
        _, src = _carve(src_shapes, torch.bfloat16, -1.0)
        tgt_flat, tgt = _carve(tgt_shapes, torch.bfloat16, float("nan"))
        for i, m in enumerate(sources):
            if self.rank in m.ranks:
                _pieces_copy(src[m.name], m.ranks[self.rank], _logical(i, m.shape), True)
        executor = Executor(self.group, ExecuteOptions(staging_cap_bytes=spec["cap_mib"] << 20, timeout=600))
        executor.execute(half, src, tgt)
        ok = True
        for i, m in enumerate(targets):
            if self.rank in m.ranks:
                expected = torch.full(m.ranks[self.rank].shape, float("nan"), dtype=torch.bfloat16)
                _pieces_copy(expected, m.ranks[self.rank], _logical(i, m.shape), True)
                ok &= torch.equal(expected.view(torch.int16), tgt[m.name].view(torch.int16))
        verified = self.slowest(0.0 if ok else 1.0) == 0.0
        times = []
        for i in range(self.args.warmup + self.args.syncs):
            t = self.timed(lambda: executor.execute(half, src, tgt))
            if i >= self.args.warmup:
                times.append(t)
        schedule = executor.schedule
        if schedule is None:
            raise RuntimeError("the executor ran no schedule")
        work = rank_work(half, schedule)
        executor.close()
        del tgt_flat
        return {
            "layout": name,
            "measured_s": statistics.median(times),
            "all_s": [round(t, 4) for t in times],
            "verified": verified,
            "work": work,
        }

    def run(self) -> dict[str, Any]:
        links = self.links()
        rows = [self.row(name, spec) for name, spec in ROWS.items() if name in self.args.rows]
        return {"rank": self.rank, "links": links, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks model", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or not args.rows:
        parser.error(f"--rows takes {list(ROWS)}, found {unknown or args.rows}")

    results = spawn_ranks(args, _Rank)
    links = results[0]["links"]
    print(
        f"links: {links.message_s * 1e6:.0f} us per message, streams "
        + ", ".join(f"{k}: {g:.2f} GB/s" for k, g in sorted(links.stream_gbps.items()))
        + f", copy {links.copy_gbps:.2f} GB/s, agree {links.agree_s * 1e3:.2f} ms"
    )
    rows = []
    for index, name in enumerate(args.rows):
        per_rank = [r["rows"][index] for r in results]
        works = [r["work"] for r in per_rank]
        modeled = modeled_sync(works, links)
        measured = float(per_rank[0]["measured_s"])
        row = {
            "layout": name,
            "measured_s": round(measured, 4),
            "modeled_s": round(modeled.seconds, 4),
            "ratio": round(modeled.seconds / measured, 3),
            "verified": all(r["verified"] for r in per_rank),
            "bytes": sum(sum(w.sent.values()) for w in works),
            "rounds": max(w.rounds for w in works),
            "messages": max(w.messages for w in works),
            "all_s": per_rank[0]["all_s"],
            "parts": {str(r): {k: round(v, 4) for k, v in p.items()} for r, p in modeled.parts.items()},
        }
        rows.append(row)
        print(
            f"{name:15} measured {row['measured_s']:.3f} s, modeled {row['modeled_s']:.3f} s "
            f"(ratio {row['ratio']:.2f}); {row['bytes'] / 2**20:.0f} MiB, {row['rounds']} rounds, "
            f"{row['messages']} messages; slowest modeled rank {modeled.slowest}: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in modeled.parts[modeled.slowest].items())
        )
    if args.json:
        print(json.dumps({"links": asdict(links), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
