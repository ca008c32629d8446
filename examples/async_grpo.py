"""Asynchronous GRPO: generation never stops; the trainer steps and syncs while requests are in flight.

    python examples/async_grpo.py --steps 4                 # ZeRO-3 on 2 trainer ranks, vLLM AsyncLLM at TP 2
    python examples/async_grpo.py --steps 4 --kv recompute  # frozen requests recompute their KV cache

One program on one machine, no download (a tiny Qwen3 made locally), as ``examples/grpo.py`` but
asynchronous, the way PipelineRL, AReaL or prime-rl run: a generator task keeps the engine full of
sampled groups (``--group`` completions per prompt) and queues each finished group; the trainer loop takes
``--prompts`` groups per step, takes a policy-gradient step on them (the trainer hook syncs after it), and
the engine receives that sync in keep mode (``receive_sync_async``): the requests
in flight are frozen, the weights land, and they go on with the new version from their next token.

Per step it reports the staleness of the samples it trained on, from vLLM's per-token weight versions
(``CompletionOutput.weight_versions``): how many versions behind the trainer each sample's oldest token was,
and the share of samples whose tokens came from more than one version; and the generation stall of the
sync (the engine paused, from the pause to the resume). The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from grpo import GOOD_TOKENS, attach, engine_env, grpo_step, setup  # the trainer ranks' commands


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help="groups per training step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group size)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--in-flight", type=int, default=6, help="groups the generator keeps in the engine")
    ap.add_argument("--kv", choices=("keep", "recompute"), default="keep", help="frozen requests' KV cache")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rollout-sync-async-grpo"))
    return ap.parse_args(argv)


def staleness(version: int, outputs: list[Any]) -> list[int]:
    """For each completion: how many versions its oldest token is behind ``version`` (the weights the
    step trains from)."""
    return [version - min(int(s.version) for s in out.weight_versions) for out in outputs]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from ranks import Ranks, free_port
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_sync import connect_engine_async, receive_sync_async, setup_engines_async
    from rollout_sync.tiny import make_tiny_model

    model = make_tiny_model("dense", Path(args.workdir) / "tiny-dense", seed=0)
    engine_env(2)
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model),
            tensor_parallel_size=2,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=args.in_flight * args.group,
            kv_cache_memory_bytes=64 * 2**20,
            seed=0,
            worker_extension_cls="vllm_plugin.extension.RolloutSyncExtension",
        )
    )
    loop = asyncio.get_running_loop()
    token = secrets.token_hex(16)
    summary: dict[str, Any] = {"steps": []}
    with Ranks(2, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=900) as ranks:
        await loop.run_in_executor(None, ranks.call, setup, str(model), {"zero": 3, "lr": args.lr})
        await setup_engines_async([engine], first_rank=2)
        address = f"tcp://127.0.0.1:{free_port()}"
        joining = ranks.submit(attach, address, token, False)
        await connect_engine_async(engine, address, 0, token=token, atomic=True)
        await loop.run_in_executor(None, joining.result, 240)
        await engine.update_weight_version("0")  # both start from the same checkpoint: version 0
        print("[async-grpo] trainer and engine joined; generation starts", flush=True)

        groups: asyncio.Queue[tuple[list[int], list[Any]]] = asyncio.Queue()
        gen = random.Random(0)
        stop = asyncio.Event()

        async def one_group(k: int) -> None:
            prompt = [gen.randrange(4, 1000) for _ in range(6)]
            params = SamplingParams(
                n=args.group, temperature=1.0, max_tokens=args.max_tokens, seed=k, ignore_eos=True
            )
            final = None
            async for out in engine.generate({"prompt_token_ids": prompt}, params, f"group-{k}"):
                final = out
            assert final is not None
            await groups.put((prompt, list(final.outputs)))

        async def generator() -> None:  # keeps ``in_flight`` groups in the engine, all the time
            running: set[asyncio.Task[None]] = set()
            k = 0
            while not stop.is_set():
                while len(running) < args.in_flight:
                    k += 1
                    running.add(asyncio.ensure_future(one_group(k)))
                done, running = await asyncio.wait(running, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            for task in running:
                task.cancel()

        generating = asyncio.ensure_future(generator())
        version = 0
        for step in range(1, args.steps + 1):
            taken = [await groups.get() for _ in range(args.prompts)]
            batch, rewards, outputs = [], [], []
            for prompt, group in taken:
                scores = [
                    sum(t in GOOD_TOKENS for t in c.token_ids) / max(len(c.token_ids), 1) for c in group
                ]
                mean = statistics.fmean(scores)
                std = statistics.pstdev(scores)
                batch += [
                    (prompt, list(c.token_ids), (s - mean) / (std + 1e-4))
                    for c, s in zip(group, scores, strict=True)
                ]
                rewards += scores
                outputs += group
            behind = staleness(version, outputs)
            mixed = sum(len(o.weight_versions) > 1 for o in outputs) / len(outputs)
            pending = ranks.submit(grpo_step, batch)  # the hook syncs after the optimizer step

            paused_at: list[float] = []

            async def look(_: int, paused_at: list[float] = paused_at) -> None:
                paused_at.append(time.perf_counter())

            reports = await receive_sync_async([engine], kv=args.kv, on_paused=look)
            stall = time.perf_counter() - paused_at[0]
            results = await loop.run_in_executor(None, pending.result, 300)
            version = int(reports[0][0]["version"])
            row = {
                "step": step,
                "reward": round(statistics.fmean(rewards), 4),
                "loss": round(results[0]["loss"], 4),
                "version": version,
                "staleness_max": max(behind),
                "staleness_mean": round(statistics.fmean(behind), 3),
                "mixed_version_samples": round(mixed, 3),
                "stall_s": round(stall, 4),
                "sync_s": round(max(float(r["seconds"]) for r in reports[0]), 4),
                "engine_weight_version": await engine.get_weight_version(),
            }
            summary["steps"].append(row)
            print(
                f"step {step}: reward {row['reward']:.3f}, synced v{version} in {row['sync_s'] * 1000:.0f} ms, "
                f"generation stalled {row['stall_s'] * 1000:.0f} ms; samples trained on: up to "
                f"{row['staleness_max']} version(s) behind (mean {row['staleness_mean']}), "
                f"{row['mixed_version_samples']:.0%} with tokens of two versions",
                flush=True,
            )
        stop.set()
        await generating
    # Past vLLM's own worker grace (5 s, then 4 s after SIGTERM): with its default 5 s the parent force-kills
    # the engine core while that core is still reaping its workers, and a worker gone in between raises
    # psutil.NoSuchProcess out of shutdown (vLLM 0.32, seen in CI).
    engine.shutdown(timeout=30)
    summary["ok"] = all(r["engine_weight_version"] == str(r["version"]) for r in summary["steps"])
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    summary = asyncio.run(run(args))
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
