"""Syncs into an engine that keeps generating: the stall each pause mode costs the requests in flight.

``python -m benchmarks inflight [--json] [--requests 8,32] [--max-tokens 96]``

One vLLM ``AsyncLLM`` at TP 2 (Qwen3-0.6B's shapes, random bf16 weights; this process drives it on its event
loop) and DeepSpeed ZeRO-3 on 2 trainer ranks (SGD, never stepped; before each sync the trainer's weights
are negated in place, so every byte is new), on this host. The engine's workers join with ``atomic=True``.
Per row, ``N`` greedy requests (32-token prompts, ``--max-tokens`` each) are started; once every one of them
has 8 tokens, one sync runs in each of vLLM's pause modes (``vllm_plugin.async_driver.receive_sync_async``),
on a fresh set of ``N`` requests each time:

- ``stall_keep_s``: keep mode, from the pause to the first new token of a frozen request;
- ``stall_wait_s``: wait mode (the requests drain on the old weights, then the sync), from the pause to the
  first token of a request submitted at the pause;
- ``stall_abort_s``: abort mode (the requests are aborted, the sync runs, they are submitted again from
  their prompts), from the pause to the first token of a resubmitted request; ``tokens_lost``: the tokens the
  aborted requests had generated (``tokens_lost_keep``: the same count in keep mode, where every request
  still returns all of its tokens);
- ``sync_s``: the keep-mode sync itself (the slowest worker's whole receive, with what it rebuilds after the
  commit, as it reports it); ``resume_after_s``: from
  the pause to the resume in keep mode (the sync with the driver's calls around it);
- ``step_s``: the median time between two tokens of a request while all ``N`` run, before the syncs;
- ``versions_exact``: in keep mode, every request's ``weight_versions`` spans split its tokens exactly where
  it stood when the engine paused (the tokens its stream had delivered by then);
- ``bitwise_equal``: after the row's syncs, the trainer's own checkpoint written through vLLM's loader maps
  changes no parameter of the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from .sync import (
    BUCKETS,
    EXTENSION,
    MODEL_KIND,
    REPO_ROOT,
    TOKEN,
    TP,
    TRAINER_ENV,
    TRAINERS,
    ours_sync,
    perturb,
)

__all__ = ["main"]

PROMPT_TOKENS = 32
STARTED_TOKENS = 8  # every request has this many tokens when a sync is asked for
_T = TypeVar("_T")


def _log(msg: str) -> None:
    print(f"[bench inflight {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Loop:
    """The engine's event loop, on its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, _T], timeout: float = 1800.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Request:
    """One streamed greedy request: when each token count arrived, and its final output."""

    def __init__(self, engine: Any, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.rid, self.prompt = rid, prompt
        self.arrivals: list[tuple[float, int]] = []
        self.output: Any = None
        self.task = asyncio.ensure_future(self._run(engine, max_tokens))

    async def _run(self, engine: Any, max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for out in engine.generate({"prompt_token_ids": self.prompt}, params, self.rid):
            self.arrivals.append((time.perf_counter(), len(out.outputs[0].token_ids)))
            self.output = out.outputs[0]

    @property
    def tokens(self) -> int:
        return self.arrivals[-1][1] if self.arrivals else 0

    def first_after(self, count: int) -> float | None:
        """When a token past ``count`` arrived."""
        return next((t for t, n in self.arrivals if n > count), None)


def prompts(n: int, offset: int) -> list[list[int]]:
    return [[(97 * (offset + i) + 13 * j) % 150_000 + 10 for j in range(PROMPT_TOKENS)] for i in range(n)]


async def started(requests: list[Request], timeout: float = 600.0) -> None:
    deadline = time.perf_counter() + timeout
    while min(r.tokens for r in requests) < STARTED_TOKENS:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the requests did not reach {STARTED_TOKENS} tokens in {timeout:g} s")
        await asyncio.sleep(0.005)


async def one_row(
    engine: Any, pool: Any, n: int, max_tokens: int, version: int, label: int
) -> dict[str, Any]:
    from vllm_plugin.async_driver import receive_sync_async

    row: dict[str, Any] = {"requests": n, "max_tokens": max_tokens}
    loop = asyncio.get_running_loop()

    async def sync_in(mode: str, on_paused: Any = None) -> tuple[float, float, list[list[dict[str, Any]]]]:
        """One sync in ``mode``: when the pause was asked for, when generation resumed, the reports."""
        nonlocal version
        version += 1
        await loop.run_in_executor(None, pool.call, perturb)
        pending = pool.submit(ours_sync, version)
        paused_at = time.perf_counter()
        reports = await receive_sync_async([engine], mode=mode, on_paused=on_paused)  # type: ignore[arg-type]
        resumed_at = time.perf_counter()
        await loop.run_in_executor(None, pending.result, 600)
        return paused_at, resumed_at, reports

    # keep: frozen, then on with the new weights
    keep = [Request(engine, f"keep-{label}-{i}", p, max_tokens) for i, p in enumerate(prompts(n, 0))]
    await started(keep)
    gaps = [b[0] - a[0] for a, b in zip(keep[0].arrivals, keep[0].arrivals[1:], strict=False)]
    row["step_s"] = round(statistics.median(gaps), 4)
    paused_at, resumed_at, reports = await sync_in("keep")
    await asyncio.gather(*(r.task for r in keep))
    # frozen from the pause to the resume: what each had delivered before the resume is where it stopped
    at_pause = {r.rid: max((n for t, n in r.arrivals if t < resumed_at), default=0) for r in keep}
    row["resume_after_s"] = round(resumed_at - paused_at, 4)
    firsts = [t for r in keep if (t := r.first_after(at_pause[r.rid])) is not None]
    row["stall_keep_s"] = round(min(firsts) - paused_at, 4)
    row["sync_s"] = round(max(float(r["total_seconds"]) for r in reports[0]), 4)
    row["tokens_lost_keep"] = sum(max_tokens - len(r.output.token_ids) for r in keep)
    exact = True
    for r in keep:
        spans = [(s.version, s.start, s.end) for s in r.output.weight_versions or []]
        boundary = at_pause[r.rid]
        want = [(str(version - 1), 0, boundary), (str(version), boundary, max_tokens)]
        exact &= spans == [s for s in want if s[1] < s[2]]
    row["versions_exact"] = exact

    # wait: drained on the old weights, then the sync; a request submitted at the pause waits for both
    waiting = [Request(engine, f"wait-{label}-{i}", p, max_tokens) for i, p in enumerate(prompts(n, n))]
    await started(waiting)
    queued: list[Request] = []

    async def submit_new(_: int) -> None:
        queued.append(Request(engine, f"after-wait-{label}", prompts(1, 3 * n)[0], 4))

    paused_at, _, _ = await sync_in("wait", submit_new)
    await asyncio.gather(*(r.task for r in [*waiting, *queued]))
    row["stall_wait_s"] = round(queued[0].arrivals[0][0] - paused_at, 4)

    # abort: thrown away, the sync, submitted again from their prompts
    aborted = [Request(engine, f"abort-{label}-{i}", p, max_tokens) for i, p in enumerate(prompts(n, 2 * n))]
    await started(aborted)
    paused_at, _, _ = await sync_in("abort")
    await asyncio.gather(*(r.task for r in aborted), return_exceptions=True)
    row["tokens_lost"] = sum(r.tokens for r in aborted)
    again = [Request(engine, f"again-{label}-{i}", r.prompt, max_tokens) for i, r in enumerate(aborted)]
    await started(again[:1], timeout=600)
    row["stall_abort_s"] = round(min(r.arrivals[0][0] for r in again if r.arrivals) - paused_at, 4)
    await asyncio.gather(*(r.task for r in again))
    row["version"] = version
    return row


def run(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    from testbed.deepspeed import DeepSpeedSpec
    from testbed.rank_pool import RankPool, free_port
    from testbed.trainer_ranks import attach, setup
    from vllm_plugin.async_driver import (
        Blocking,
        connect_engine_async,
        receive_sync_async,
        setup_engines_async,
    )

    from .sync import _check_bitwise

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = Loop()
    sizes = [int(n) for n in args.requests.split(",")]
    engine_args = AsyncEngineArgs(
        model=str(model),
        tensor_parallel_size=TP,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=PROMPT_TOKENS + args.max_tokens + 8,
        max_num_seqs=max(sizes) + 1,
        kv_cache_memory_bytes=args.kv_mib * 2**20,
        seed=0,
        worker_extension_cls=EXTENSION,
    )

    async def start() -> Any:
        return AsyncLLM.from_engine_args(engine_args)

    started_at = time.perf_counter()
    engine = loop.run(start())
    _log(f"vLLM AsyncLLM TP {TP} up in {time.perf_counter() - started_at:.1f} s")
    extra: dict[str, Any] = {"zero_allow_untested_optimizer": True, "zero_optimization": dict(BUCKETS)}
    spec = DeepSpeedSpec("dense-tied", zero_stage=3, optimizer="sgd", extra_config=extra)
    rows = []
    try:
        with RankPool(TRAINERS, env=TRAINER_ENV, timeout=args.timeout * 4) as pool:
            loop.run(setup_engines_async([engine], first_rank=TRAINERS))
            pool.call(setup, spec, str(model))
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = pool.submit(
                attach, address, TOKEN, 1, None, "balanced", args.timeout, None, True, False
            )
            loop.run(connect_engine_async(engine, address, 0, token=TOKEN, timeout=args.timeout, atomic=True))
            pending.result(args.timeout * 2)
            _log("trainer and engine joined (atomic syncs)")
            version = 1  # a first sync with nothing in flight: the engine's weight version is a number
            pool.call(perturb)
            pending = pool.submit(ours_sync, version)
            loop.run(receive_sync_async([engine]))
            pending.result(args.timeout * 2)
            for k, n in enumerate(sizes):
                row = loop.run(one_row(engine, pool, n, args.max_tokens, version, k))
                version = row.pop("version")
                blocking = Blocking(engine, loop.loop)
                equal, _ = _check_bitwise(pool, blocking, args.workdir / "check-inflight", model)  # type: ignore[arg-type]
                row["bitwise_equal"] = bool(equal)
                _log(f"row {json.dumps(row)}")
                rows.append(row)
    finally:
        engine.shutdown(timeout=30)  # past vLLM's worker grace; see examples/async_grpo.py
        loop.close()
        shutil.rmtree(args.workdir / "check-inflight", ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks inflight", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "rollout-sync")
    parser.add_argument("--requests", default="8,32", help="requests in flight per row")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens each request generates")
    parser.add_argument("--kv-mib", type=int, default=512, help="the engine's KV cache per worker, MiB")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"
    from testbed.shaped_models import make_shaped_model

    model = make_shaped_model(MODEL_KIND, args.workdir / MODEL_KIND)
    rows = run(args, model)
    for r in rows:
        _log(
            f"{r['requests']} requests: keep {r['stall_keep_s']:.2f} s (sync {r['sync_s']:.2f} s + 2 steps "
            f"{2 * r['step_s']:.2f} s), wait {r['stall_wait_s']:.2f} s, abort {r['stall_abort_s']:.2f} s "
            f"({r['tokens_lost']} tokens lost; keep: {r['tokens_lost_keep']}); versions exact "
            f"{r['versions_exact']}; bitwise {r['bitwise_equal']}"
        )
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0 if all(r["bitwise_equal"] and r["versions_exact"] for r in rows) else 1
