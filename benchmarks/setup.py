"""Setup benchmark: a vLLM worker's target maps from shapes (checked by the loader trace) against the
element probe, on the same live engine.

``python -m benchmarks setup [--json] [--workdir DIR] [--cap-mib 64]``

Model: Qwen3-0.6B's shapes with random bf16 weights (``testbed.shaped_models``), one vLLM CPU
engine at TP 2 with ``testbed.baseline_extension.BenchExtension``. On that engine, one after the other:

- ``fast``: ``rollout_sync_setup(maps="fast")`` on every worker (``vllm_plugin.worker_maps``: maps from the
  model's shapes and vLLM's parallel config, confirmed by tracing vLLM's loaders on the meta device);
- ``full``: ``rollout_sync_setup(maps="probe")``: vLLM's loaders probed element by element.

``fast_s`` / ``full_s``: the driver's wall time of the setup call on every worker of the engine (one
``collective_rpc``; the workers run concurrently), including fetching every worker's targets. Peak extra
memory: the kernel's RSS high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the RSS
just before the setup, in each worker; the largest over the workers. ``maps_equal``: every worker's targets
from the fast path equal the full probe's (``rollout_sync.rollout.check.target_differences``: the same maps,
storage views, refused and absent tensors). ``staging_cap_bytes``: the sync's staging cap, the bound the
issue sets for the fast path's peak.

Last line with ``--json``: ``{"fast_s", "full_s", "maps_equal", "fast_peak_extra_bytes",
"full_peak_extra_bytes", "staging_cap_bytes", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .sync import MODEL_KIND, TRAINERS, start_engine, stop_engine

__all__ = ["main"]


def _log(msg: str) -> None:
    print(f"[bench setup] {msg}", file=sys.stderr, flush=True)


def _setup(llm: Any, maps: str) -> tuple[float, list[dict[str, Any]]]:
    from vllm_plugin.calls import call

    start = time.perf_counter()
    workers = call(llm, "bench_setup", kwargs={"first_rank": TRAINERS, "maps": maps}, name="0")
    return time.perf_counter() - start, list(workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks setup", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "rollout-sync")
    parser.add_argument("--cap-mib", type=int, default=64, help="staging cap the fast path is held to, MiB")
    args = parser.parse_args(argv)
    from rollout_sync.rollout.check import target_differences
    from rollout_sync.rollout.codec import local_targets_from_dict
    from testbed.shaped_models import make_shaped_model

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = make_shaped_model(MODEL_KIND, args.workdir / MODEL_KIND)
    start = time.perf_counter()
    llm, pids = start_engine(model)
    _log(f"vLLM TP-2 engine of {model.name} started in {time.perf_counter() - start:.1f} s")
    try:
        fast_s, fast = _setup(llm, "fast")
        _log(f"fast: {fast_s:.2f} s; workers {[round(w['seconds'], 2) for w in fast]} s")
        full_s, full = _setup(llm, "probe")
        _log(f"full: {full_s:.2f} s; workers {[round(w['seconds'], 2) for w in full]} s")
    finally:
        left = stop_engine(llm, pids)
        if left:
            _log(f"killed processes the engine left behind: {left}")
    differences = []
    for a, b in zip(fast, full, strict=True):
        differences += target_differences(
            local_targets_from_dict(a["targets"]), local_targets_from_dict(b["targets"])
        )
    for line in differences[:10]:
        _log(f"differs: {line}")
    row = {
        "fast_s": round(fast_s, 3),
        "full_s": round(full_s, 3),
        "maps_equal": not differences,
        "fast_peak_extra_bytes": max(int(w["extra_bytes"]) for w in fast),
        "full_peak_extra_bytes": max(int(w["extra_bytes"]) for w in full),
        "staging_cap_bytes": args.cap_mib << 20,
        "speedup": round(full_s / fast_s, 1) if fast_s > 0 else None,
        "tensors": len(fast[0]["targets"]["tensors"]) if fast else 0,
        "fast_trace_s": round(max(w["summary"]["setup"]["trace_seconds"] for w in fast), 3),
        "fast_probed": max(int(w["summary"]["setup"]["probed"]) for w in fast),
        "memory_method": fast[0]["memory_method"] if fast else "",
    }
    print(
        f"setup at {MODEL_KIND}, TP 2: fast {row['fast_s']:.2f} s, full probe {row['full_s']:.2f} s "
        f"({row['speedup']}x); peak extra fast {row['fast_peak_extra_bytes'] / 2**20:.1f} MiB, full "
        f"{row['full_peak_extra_bytes'] / 2**20:.1f} MiB (cap {args.cap_mib} MiB); maps equal {row['maps_equal']}"
    )
    if args.json:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
