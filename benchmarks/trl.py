"""``python -m benchmarks trl --json``: TRL's own weight sync against rollout-sync's, in TRL's
colocate mode, with DeepSpeed ZeRO-3 and ZeRO-2 on 2 CPU processes, in the same run.

Each row launches ``accelerate launch`` (DeepSpeed, 2 processes, ``use_cpu``) on this module's worker. Every
process builds the DeepSpeed engine through accelerate (as TRL's Trainer does) and TRL's own
``VLLMGeneration(mode="colocate")`` (its ``vllm.LLM`` with ``external_launcher`` in the process), then, per
step: one optimizer step on random tokens; vLLM's parameters zeroed; TRL's ``VLLMGeneration.sync_weights``
(gather each parameter, ``load_weights``), timed, digests taken; zeroed again; rollout-sync's sync (the
same object ``use_rollout_sync`` installs), timed, digests taken. ``bitwise_equal``: after every step both
syncs left vLLM's parameters with the same bytes on every process. The zeroing makes each sync write
everything it claims to. Where vLLM keeps layers in another form (packed linear layers on AVX-512 CPUs),
TRL's sync runs inside vLLM's layerwise reload, as a TRL user there would have to, and such layers are not
zeroed (their weights are empty).

Seconds: the slower process, after a barrier, median over the measured steps (a warm-up step first: our
attach, TRL's first-pass metadata). Extra memory: the process's high-water mark during the sync minus its
resident memory before (``testbed.peak_memory``), the larger process; in colocate mode the
process is trainer rank and vLLM worker at once. Shapes: Qwen3-0.6B's with 14 of its 28 layers by default
(every tensor shape of Qwen3-0.6B, vocab 151,936 tied, 0.38B elements; random bf16 weights made locally;
the trainer trains in fp32): the largest Qwen3 shapes whose two colocated processes fit in this machine's
23 GB. With all 28 layers (``--shapes qwen3-0.6b-shapes``) the first training step had the kernel kill a
process at 12.1-12.3 GB, with AdamW and with SGD alike. The optimizer is SGD (the sync reads the same ZeRO
partitions whatever the optimizer; it leaves more room).

Last line: ``{"rows": [{"mode", "zero", "ours_s", "trl_s", "bitwise_equal", "ours_trainer_extra_bytes",
"trl_trainer_extra_bytes", ...}]}``. vLLM runs eager (TRL offers no switch; on CPU its compile takes minutes).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = ("qwen3-0.6b-shapes-14-layers", "qwen3-0.6b-shapes", "tiny")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks trl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    ap.add_argument("--shapes", choices=SHAPES, default=SHAPES[0])
    ap.add_argument("--zero", type=int, nargs="+", default=[3, 2], choices=(2, 3))
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rollout-sync-bench-trl"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from examples.cpu import colocated_cpu_env
    from testbed.launched import build_checkpoint

    args = parse(argv)
    if args.worker:
        colocated_cpu_env()  # before vLLM is imported
        return worker(args)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = build_checkpoint("dense" if args.shapes == "tiny" else args.shapes, work / args.shapes)
    rows = []
    for zero in args.zero:
        row = run_row(zero, model, work, args.steps)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr if args.json else sys.stdout, flush=True)
    summary = {"rows": rows}
    print(json.dumps(summary), flush=True)
    return 0 if rows and all(r["bitwise_equal"] for r in rows) else 1


def run_row(zero: int, model: Path, work: Path, steps: int) -> dict[str, Any]:
    ds = work / f"ds_zero{zero}.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": zero},
                "bf16": {"enabled": False},
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
            }
        )
    )
    cfg = work / f"accelerate_zero{zero}.yaml"
    cfg.write_text(
        "\n".join(
            [
                "compute_environment: LOCAL_MACHINE",
                "distributed_type: DEEPSPEED",
                "deepspeed_config:",
                f"  deepspeed_config_file: {ds}",
                "  zero3_init_flag: false",
                "num_machines: 1",
                "num_processes: 2",
                "machine_rank: 0",
                "use_cpu: true",
                "rdzv_backend: static",
                "same_network: true",
                "",
            ]
        )
    )
    out = work / f"row_zero{zero}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("MALLOC_ARENA_MAX", "2")  # a thread's arena each (vLLM, gloo, ...) grew RSS by gigabytes
    root = str(Path(__file__).resolve().parents[1])  # benchmarks/ and testbed/ run from the checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(cfg),
        "-m",  # a module, not this file: as a script its folder would come first and shadow ``trl``
        "benchmarks",
        "trl",
        "--worker",
        "--model",
        str(model),
        "--out",
        str(out),
        "--steps",
        str(steps),
    ]
    log = work / f"row_zero{zero}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the ZeRO-{zero} row failed ({proc.returncode}); log {log}:\n{tail}")
    row: dict[str, Any] = json.loads(out.read_text())
    return {"mode": "colocate", "zero": zero, **row}


# ------------------------------------------------------------------------------------ in each process
def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.generation import vllm_generation
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm import LLM

    from rollout_sync.integrations.trl import TrlWeightSync, rollout_side
    from testbed.peak_memory import PeakMemory
    from vllm_plugin.rollouts import ColocatedRollout
    from vllm_plugin.worker_state import param_digest

    PartialState(cpu=True)  # as TrainingArguments(use_cpu=True) does; else each process is 0 of 1
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)  # no states: see the docstring
    engine, optimizer = accelerator.prepare(model, optimizer)
    # Eager vLLM (TRL offers no switch): on CPU torch.compile takes minutes and gigabytes at these shapes,
    # and the syncs measured here run no forward pass.
    vllm_generation.LLM = functools.partial(LLM, enforce_eager=True)  # type: ignore[misc,assignment]
    generation = VLLMGeneration(
        model=accelerator.unwrap_model(engine),
        accelerator=accelerator,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        mode="colocate",
        max_model_length=64,
        max_num_seqs=4,
        gpu_memory_utilization=0.3,
    )
    side = rollout_side(generation)
    assert isinstance(side, ColocatedRollout)
    vllm_model = side.vllm_worker.model_runner.model
    ours = TrlWeightSync(timeout=600.0)
    started = time.perf_counter()
    ours.attach(accelerator.deepspeed_engine_wrapped.engine, side)
    attach_s = time.perf_counter() - started
    forms = side.worker.loaded_forms
    packed = 0 if forms is None else len(forms.layers)
    vocab = int(model.config.vocab_size)

    def train_step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (1, 16), generator=g)
        loss = engine(input_ids=ids).logits.float().pow(2).mean() * 1e-3
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def zero_vllm() -> None:
        with torch.no_grad():
            for p in vllm_model.parameters():
                if p.numel():
                    p.zero_()

    def digests() -> dict[str, str]:
        return {n: param_digest(p.data) for n, p in vllm_model.named_parameters()}

    def trl_sync() -> None:
        if not packed:
            VLLMGeneration.sync_weights(generation)
            return
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(vllm_model)
        VLLMGeneration.sync_weights(generation)
        finalize_layerwise_reload(vllm_model, generation.llm.llm_engine.vllm_config.model_config)

    def timed(fn: Any) -> tuple[float, int]:
        dist.barrier()
        mem = PeakMemory().start()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        extra = mem.stop()
        dist.barrier()
        return seconds, extra

    rows: list[dict[str, Any]] = []
    for step in range(args.steps + 1):
        train_step(step)
        zero_vllm()
        trl_s, trl_extra = timed(trl_sync)
        after_trl = digests()
        zero_vllm()
        ours_s, ours_extra = timed(lambda: ours.sync())
        after_ours = digests()
        rows.append(
            {
                "trl_s": trl_s,
                "ours_s": ours_s,
                "trl_extra": trl_extra,
                "ours_extra": ours_extra,
                "equal": after_trl == after_ours,
            }
        )
    measured = rows[1:]
    mine = {
        "trl_s": statistics.median(r["trl_s"] for r in measured),
        "ours_s": statistics.median(r["ours_s"] for r in measured),
        "trl_extra": max(r["trl_extra"] for r in measured),
        "ours_extra": max(r["ours_extra"] for r in measured),
        "equal": all(r["equal"] for r in rows),
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        last = ours.history[-1]
        row = {
            "ours_s": round(max(m["ours_s"] for m in every), 4),
            "trl_s": round(max(m["trl_s"] for m in every), 4),
            "speedup": round(max(m["trl_s"] for m in every) / max(m["ours_s"] for m in every), 2),
            "bitwise_equal": all(m["equal"] for m in every),
            "ours_trainer_extra_bytes": max(m["ours_extra"] for m in every),
            "trl_trainer_extra_bytes": max(m["trl_extra"] for m in every),
            "staging_cap_bytes": last.stats.staging_cap_bytes,
            "bytes_sent_rank0": sum(last.stats.bytes_sent.values()),
            "in_process_bytes_rank0": ours.in_process_bytes(last),
            "attach_s": round(attach_s, 2),
            "packed_layers": packed,
            "trainer_ranks": int(accelerator.deepspeed_engine_wrapped.engine.dp_world_size),
            "steps": args.steps,
            "model": str(args.model),
        }
        Path(args.out).write_text(json.dumps(row))
    dist.barrier()
    ours.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
