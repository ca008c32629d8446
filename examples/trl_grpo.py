"""GRPO with TRL's ``GRPOTrainer`` and DeepSpeed, the weights synced into vLLM by rollout-sync.

Colocate mode (each trainer process holds its own vLLM engine)::

    accelerate launch --config_file examples/trl/zero3.yaml examples/trl_grpo.py --mode colocate --verify

Server mode (a vLLM server with the rollout-sync worker extension; generation goes through TRL's client)::

    python -m rollout_sync.tiny dense /tmp/rollout-sync-trl/model
    VLLM_SERVER_DEV_MODE=1 python -m vllm_plugin.serve serve /tmp/rollout-sync-trl/model --port 8000 \\
        --worker-extension-cls vllm_plugin.extension.RolloutSyncExtension --max-model-len 128
    accelerate launch --config_file examples/trl/zero3.yaml examples/trl_grpo.py --mode server --verify

``examples/trl/zero2.yaml`` runs ZeRO-2. Everything is local: a tiny Qwen3 made on the spot (no download),
an in-memory data set of prompts, a verifiable reward (the share of completion tokens in the lower half of
the vocabulary). The two lines marked ``rollout-sync`` are all a TRL user adds: TRL's weight sync (gather
every parameter, ``load_weights`` or an NCCL broadcast) becomes rollout-sync's, which sends each element
straight from the DeepSpeed rank that stores it to every vLLM worker that stores it. ``--sync trl`` runs
TRL's own sync instead (colocate mode only on CPU: TRL's server-mode sync needs CUDA).

With ``--verify``, after every sync the trainer's weights, gathered by DeepSpeed itself, are written into
vLLM through vLLM's own loader maps, and the example checks that not one bit changed. The last line printed
(rank 0) is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOOD_TOKENS = range(4, 500)  # the reward: completion tokens with these ids (the tiny vocabulary has 1000)
VERIFIED: list[bool] = []  # with --verify: one entry per sync, True if vLLM held the trainer's weights


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("colocate", "server"), default="colocate")
    ap.add_argument("--sync", choices=("rollout-sync", "trl"), default="rollout-sync")
    ap.add_argument("--server-url", default="http://127.0.0.1:8000")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rollout-sync-trl"))
    ap.add_argument("--verify", action="store_true", help="check after each sync that vLLM holds the weights")
    ap.add_argument(
        "--peft", action="store_true", help="train a LoRA adapter (PEFT); vLLM gets merged weights"
    )
    return ap.parse_args(argv)


def reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [sum(t in GOOD_TOKENS for t in ids) / max(len(ids), 1) for ids in completion_ids]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from cpu import colocated_cpu_env, tiny_checkpoint  # this folder's CPU helpers

    colocated_cpu_env()  # before vLLM is imported

    import torch
    from accelerate import PartialState
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    state = PartialState(cpu=True)  # the 2-process gloo world (without cpu=True: process 0 of 1 on each)
    model = Path(args.workdir) / "model"
    if state.is_main_process:
        tiny_checkpoint("dense", model)
    state.wait_for_everyone()

    sync = None
    if args.sync == "rollout-sync":
        from rollout_sync import use_rollout_sync  # rollout-sync

        sync = use_rollout_sync()  # rollout-sync: TRL's weight sync becomes rollout-sync's
        if args.verify:
            sync.after_sync.append(lambda s: verify(s, model, Path(args.workdir) / "verify"))

    prompts = [" ".join(f"w{(7 * i + j) % 97}" for j in range(4)) for i in range(16)]
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "out"),
        use_cpu=True,
        bf16=False,
        learning_rate=args.lr,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.grad_accum,
        num_generations=4,
        max_completion_length=8,
        use_vllm=True,
        vllm_mode=args.mode,
        vllm_server_base_url=args.server_url if args.mode == "server" else None,
        vllm_max_model_length=128,
        vllm_gpu_memory_utilization=0.5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=peft_config,
    )
    started = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - started
    summary: dict[str, Any] = {"mode": args.mode, "sync": args.sync, "train_s": round(total_s, 2)}
    if sync is not None:
        summary.update(sync.summary())
    if args.verify:
        summary["verified"] = sum(VERIFIED)
        summary["all_verified"] = bool(VERIFIED) and all(VERIFIED) and len(VERIFIED) == summary.get("syncs")
    if state.is_main_process:
        print(json.dumps(summary), flush=True)
    state.wait_for_everyone()
    return 1 if args.verify and not summary["all_verified"] else 0


def verify(sync: Any, model_dir: Path, out: Path) -> None:
    """vLLM must hold the trainer's weights, as DeepSpeed itself gathers them, bit for bit."""
    import torch.distributed as dist

    good, changed = sync.verify(str(model_dir), str(out))
    VERIFIED.append(good)
    if dist.get_rank() == 0:
        version = sync.history[-1].version
        what = "vLLM holds the trainer weights bit for bit" if good else f"MISMATCH (changed: {changed[:5]})"
        print(f"[trl_grpo] sync v{version}: {what}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
