"""Planner benchmark: ours against DeepSpeed's ``plan_transfer`` in the same run, and the Qwen3-8B case.

``python -m benchmarks plan [--json] [--pieces 64,256,1024,4096] [--repeat 3] [--cap 60]
[--no-deepspeed]``

- ``single``: one ``[8192, 8192]`` tensor, ``N`` pieces per side. Source: ``N`` row blocks, one per rank
  (ranks ``0..N-1``, N-D storage). Target: 8 column blocks (TP 8) times ``N/8`` runs of whole rows each
  (ZeRO-like partitions of a column block, ranks ``N..2N-1``, each run a 2-D storage so that DeepSpeed
  0.19.8 accepts it). ``ours_s`` times building both maps (validation included, from fresh storages) and
  planning; ``deepspeed_s`` times ``plan_transfer`` alone on the same layout converted to its IR, with a
  raised ``PlanBudget``, in a child process capped at ``--cap`` seconds of its own CPU time (the machines
  here are shared: a wall-clock cap would measure the neighbours; on an idle machine the two agree);
  ``null`` when refused or capped. ``*_cpu_s`` are the CPU seconds of the same runs (``process_time``).
  ``ours_flat_s`` is our planner on the same target cut into flat 1-D runs that start mid-row (DeepSpeed
  0.19.8 refuses those).
- ``qwen3_8b``: Qwen3-8B shapes; sources AutoTP-2 × ZeRO-3 DP-4 (ranks 0-7), targets one vLLM-like TP-4
  engine with fused qkv / gate_up storage (ranks 8-11), built by ``rollout_sync.shapes``. ``maps_s``:
  building every map (validation included); ``plan_s``: ``plan_model`` with the ``lowest`` policy;
  ``plan_balanced_s`` with ``balanced``; ``deepspeed_s``: DeepSpeed's ``plan_transfer`` on the same maps
  (each tensor converted through ``interop.to_deepspeed`` first, untimed; the planner's time summed over
  the tensors), in a child process under the same CPU cap, ``null`` with ``deepspeed_note`` saying why when
  it refuses a tensor or runs past the cap.

Times are the best of ``--repeat`` runs (``time.perf_counter``). With ``--json`` the last line printed is
one JSON object with both results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from rollout_sync.layout.box import Box
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.layout.runs import flat_run_boxes
from rollout_sync.planning.planner import plan_model

SIZE = 8192
COLUMN_BLOCKS = 8


def _row_sources(n: int) -> dict[int, RankStorage]:
    rows = SIZE // n
    return {
        r: RankStorage((rows, SIZE), (Piece(Box((r * rows, 0), (rows, SIZE)), 0, (SIZE, 1), (r,)),))
        for r in range(n)
    }


def _block_targets(n: int) -> dict[int, RankStorage]:
    runs = n // COLUMN_BLOCKS
    rows = SIZE // runs
    width = SIZE // COLUMN_BLOCKS
    out = {}
    rank = n
    for c in range(COLUMN_BLOCKS):
        for k in range(runs):
            box = Box((k * rows, c * width), (rows, width))
            out[rank] = RankStorage((rows, width), (Piece(box, 0, (width, 1), (rank,)),))
            rank += 1
    return out


def _flat_targets(n: int) -> dict[int, RankStorage]:
    """Each column block's flattening cut into ``n/8`` equal runs (ZeRO-3 partitions, mid-row starts),
    each a 1-D storage; pieces are the runs' head/body/tail boxes."""
    runs = n // COLUMN_BLOCKS
    width = SIZE // COLUMN_BLOCKS
    numel = SIZE * width
    part = -(-numel // runs) + 1  # not a multiple of the row: partitions start mid-row
    out = {}
    rank = n
    for c in range(COLUMN_BLOCKS):
        for k in range(runs):
            start, stop = min(k * part, numel), min((k + 1) * part, numel)
            pieces = []
            pos = 0
            for b in flat_run_boxes((SIZE, width), start, stop):
                box = Box((b.origin[0], b.origin[1] + c * width), b.extent)
                pieces.append(Piece(box, pos, (b.extent[1], 1), (rank,)))
                pos += b.numel
            out[rank] = RankStorage((stop - start,), tuple(pieces))
            rank += 1
    return out


def _best(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best = float("inf")
    result = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def _time_ours(
    n: int, targets: Callable[[int], dict[int, RankStorage]], repeat: int
) -> tuple[float, float, int]:
    """Best wall and CPU seconds of building both maps (validation included) and planning."""
    best = float("inf")
    best_cpu = float("inf")
    segments = 0
    for _ in range(repeat):
        src, tgt = _row_sources(n), targets(n)  # fresh storages: nothing validated before the clock starts
        t0 = time.perf_counter()
        c0 = time.process_time()
        source = TensorMap("w", (SIZE, SIZE), "bfloat16", src)
        target = TensorMap("w", (SIZE, SIZE), "bfloat16", tgt)
        plan = plan_model([source], [target])
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
        segments = len(plan)
    return best, best_cpu, segments


def _deepspeed_pairs(job: tuple[Any, ...]) -> list[tuple[str, TensorMap, TensorMap]]:
    """``(name, source, target)`` maps of a DeepSpeed job: ``("single", n)`` or ``("qwen3_8b",)``."""
    if job[0] == "single":
        n = int(job[1])
        source = TensorMap("w", (SIZE, SIZE), "bfloat16", _row_sources(n))
        target = TensorMap("w", (SIZE, SIZE), "bfloat16", _block_targets(n))
        return [("w", source, target)]
    sources, targets = _qwen3_8b_maps()
    by_name = {m.name: m for m in sources}
    return [(t.name, by_name[t.name], t) for t in targets]


def _deepspeed_child(job: tuple[Any, ...], cap: float, conn: Any) -> None:
    """DeepSpeed's ``plan_transfer`` on every pair of ``job`` (converted through the interop first, not
    timed); sends ``("ok", wall, cpu, segments)`` summed over the pairs, or why it could not plan them."""
    try:
        from deepspeed.checkpoint.affine_transfer import AffineTransferError, PlanBudget, plan_transfer

        from rollout_sync.interop.deepspeed_ir import to_deepspeed

        converted = [
            (name, to_deepspeed(source, sorted(source.ranks)), to_deepspeed(target, sorted(target.ranks)))
            for name, source, target in _deepspeed_pairs(job)
        ]
        budget = PlanBudget(
            max_pieces_per_map=1 << 30,
            max_pair_checks=1 << 60,
            max_segments=1 << 40,
            max_plan_bytes=1 << 60,
            max_merge_checks=1 << 60,
            max_merge_passes=8,
        )
        # the cap: ``cap`` CPU seconds of this child for plan_transfer (SIGXCPU ends it past that)
        soft = int(time.process_time() + cap) + 1
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(
            resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
        )
        wall = cpu = 0.0
        segments = 0
        refused: list[str] = []
        for name, ds_source, ds_target in converted:
            t0 = time.perf_counter()
            c0 = time.process_time()
            try:
                plan = plan_transfer(ds_target, ds_source, budget)
            except AffineTransferError as exc:
                if not refused:
                    refused.append(f"{name}: {exc}")
                else:
                    refused.append(name)
                continue
            finally:
                wall += time.perf_counter() - t0
                cpu += time.process_time() - c0
            segments += len(plan.segments)
        if refused:
            conn.send(
                (
                    "refused",
                    f"{len(refused)} of {len(converted)} tensors, first {refused[0]} (the other "
                    f"{len(converted) - len(refused)} planned in {wall:.3f} s)",
                )
            )
            return
        conn.send(("ok", wall, cpu, segments))
    except Exception as exc:  # report, do not hang the parent
        conn.send(("error", repr(exc)))


def _time_deepspeed(job: tuple[Any, ...], cap: float) -> tuple[float | None, float | None, str]:
    """(wall seconds, CPU seconds) of DeepSpeed's plan_transfer in a child process, or None when refused or
    past the cap of ``cap`` CPU seconds (or ten times that in wall time)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_deepspeed_child, args=(job, cap, child), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    child.close()
    got = None
    try:
        if parent.poll(10 * cap + 120):
            got = parent.recv()
    except EOFError:  # the child was ended by its CPU limit
        got = None
    if got is None:
        proc.kill()
        proc.join()
        return None, None, f"capped at {cap:.0f} CPU s (after {time.perf_counter() - t0:.0f} s)"
    proc.join()
    if got[0] == "ok":
        return float(got[1]), float(got[2]), f"{got[3]} segments"
    return None, None, f"{got[0]}: {got[1]}"


def _deepspeed_available() -> bool:
    try:  # import once in the parent so that forked children share it
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        importlib.import_module("deepspeed.checkpoint.affine_transfer")
    except Exception as exc:
        print(f"[bench plan] DeepSpeed unavailable ({exc!r}): deepspeed_s is null", file=sys.stderr)
        return False
    return True


def bench_single(pieces: list[int], repeat: int, cap: float, with_deepspeed: bool) -> list[dict[str, Any]]:
    out = []
    for n in pieces:
        if n % COLUMN_BLOCKS or SIZE % n:
            raise SystemExit(f"--pieces: {n} must divide {SIZE} and be a multiple of {COLUMN_BLOCKS}")
        ours, ours_cpu, segments = _time_ours(n, _block_targets, repeat)
        flat, _, flat_segments = _time_ours(n, _flat_targets, repeat)
        ds, ds_cpu, note = _time_deepspeed(("single", n), cap) if with_deepspeed else (None, None, "not run")
        row = {
            "pieces": n,
            "ours_s": round(ours, 6),
            "deepspeed_s": None if ds is None else round(ds, 6),
            "ours_cpu_s": round(ours_cpu, 6),
            "deepspeed_cpu_s": None if ds_cpu is None else round(ds_cpu, 6),
            "segments": segments,
            "ours_flat_s": round(flat, 6),
            "flat_segments": flat_segments,
            "speedup": None if ds is None else round(ds / ours, 1),
            "speedup_cpu": None if ds_cpu is None else round(ds_cpu / ours_cpu, 1),
        }
        print(
            f"[bench plan] single N={n}: ours {ours * 1e3:.1f} ms ({segments} segments), flat targets "
            f"{flat * 1e3:.1f} ms ({flat_segments} segments), deepspeed "
            f"{'null' if ds is None else f'{ds * 1e3:.1f} ms'} ({note})",
            file=sys.stderr,
        )
        out.append(row)
    return out


def _qwen3_8b_maps() -> tuple[list[TensorMap], list[TensorMap]]:
    from rollout_sync.geometry import trainer_maps, vllm_target_maps
    from rollout_sync.shapes import preset

    model = preset("qwen3-8b")
    sources = trainer_maps(model, zero_stage=3, dp=4, tp=2)
    targets = vllm_target_maps(model, engines=1, tp=4, first_rank=8)
    return sources, targets


def bench_qwen3_8b(repeat: int, cap: float, with_deepspeed: bool) -> dict[str, Any]:
    maps_s, (sources, targets) = _best(repeat, _qwen3_8b_maps)
    plan_s, plan = _best(repeat, lambda: plan_model(sources, targets))
    balanced_s, balanced = _best(repeat, lambda: plan_model(sources, targets, "balanced"))
    result: dict[str, Any] = {
        "tensors": len(targets),
        "source_pieces": sum(m.piece_count for m in sources),
        "target_pieces": sum(m.piece_count for m in targets),
        "segments": len(plan),
        "maps_s": round(maps_s, 6),
        "plan_s": round(plan_s, 6),
        "plan_balanced_s": round(balanced_s, 6),
        "segments_balanced": len(balanced),
    }
    ds, ds_cpu, note = _time_deepspeed(("qwen3_8b",), cap) if with_deepspeed else (None, None, "not run")
    result["deepspeed_s"] = None if ds is None else round(ds, 6)
    result["deepspeed_cpu_s"] = None if ds_cpu is None else round(ds_cpu, 6)
    result["deepspeed_note"] = note
    if ds is not None:
        result["speedup"] = round(ds / plan_s, 1)
    print(
        f"[bench plan] qwen3-8b: {result['source_pieces']} source / {result['target_pieces']} target pieces, "
        f"{result['segments']} segments; maps {maps_s * 1e3:.1f} ms + plan {plan_s * 1e3:.1f} ms "
        f"(balanced {balanced_s * 1e3:.1f} ms); DeepSpeed's plan_transfer on the same maps "
        f"{'null' if ds is None else f'{ds * 1e3:.1f} ms'} ({note})",
        file=sys.stderr,
    )
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks plan", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--pieces", default="64,256,1024,4096", help="pieces per side for the single tensor")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is reported)")
    parser.add_argument("--cap", type=float, default=60.0, help="CPU seconds DeepSpeed's planner may use")
    parser.add_argument("--no-deepspeed", action="store_true", help="do not run DeepSpeed's planner")
    args = parser.parse_args(argv)
    pieces = [int(x) for x in args.pieces.split(",") if x]
    with_deepspeed = not args.no_deepspeed and _deepspeed_available()
    result: dict[str, Any] = {
        "single": bench_single(pieces, max(1, args.repeat), args.cap, with_deepspeed),
        "qwen3_8b": bench_qwen3_8b(max(1, args.repeat), args.cap, with_deepspeed),
    }
    for row in result["single"]:
        ds = "null" if row["deepspeed_s"] is None else f"{row['deepspeed_s']:.4f}"
        print(f"single {row['pieces']:>5} pieces/side: ours {row['ours_s']:.4f} s, deepspeed {ds} s")
    q = result["qwen3_8b"]
    ds8 = "null" if q["deepspeed_s"] is None else f"{q['deepspeed_s']:.4f}"
    print(
        f"qwen3-8b: maps {q['maps_s']:.4f} s + plan {q['plan_s']:.4f} s, {q['segments']} segments; "
        f"DeepSpeed's plan_transfer {ds8} s ({q['deepspeed_note']})"
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0
