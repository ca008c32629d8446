"""A plain ``transformers.Trainer`` with DeepSpeed, each process holding its own vLLM engine, the weights
synced after every optimizer step by ``RolloutSyncCallback``::

    accelerate launch --config_file examples/trl/zero3.yaml examples/trainer_callback.py --verify

The training is a language-model step on random tokens (the point is the weight movement); each process
builds ``vllm.LLM(..., distributed_executor_backend="external_launcher")`` as TRL's colocate mode does, and
samples from it after training. With ``--verify``, after every sync the trainer's weights, gathered by
DeepSpeed itself, are written into vLLM through vLLM's own loader maps and no bit may change. The last line
printed (process 0) is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

VERIFIED: list[bool] = []


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rollout-sync-callback"))
    ap.add_argument("--verify", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from cpu import colocated_cpu_env, tiny_checkpoint  # this folder's CPU helpers

    colocated_cpu_env()  # before vLLM is imported

    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from vllm import LLM, SamplingParams

    from rollout_sync import RolloutSyncCallback

    work = Path(args.workdir)
    model_dir = work / "model"
    training = TrainingArguments(
        output_dir=str(work / "out"),
        use_cpu=True,
        bf16=False,
        learning_rate=1e-3,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.grad_accum,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    rank = dist.get_rank()
    if rank == 0:
        tiny_checkpoint("dense", model_dir)
    dist.barrier()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 1000, (64, 16), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    trainer = Trainer(model=model, args=training, train_dataset=data)
    llm = LLM(
        model=str(model_dir),
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=1,
        max_model_len=128,
        max_num_batched_tokens=4096,
        seed=rank,
        enforce_eager=True,
    )
    callback = RolloutSyncCallback(trainer, llm)  # this process's own engine (colocated)
    if args.verify:

        def verify(sync: Any) -> None:
            good, changed = sync.verify(str(model_dir), str(work / "verify"))
            VERIFIED.append(good)
            if rank == 0:
                what = "bit for bit" if good else f"MISMATCH (changed: {changed[:5]})"
                print(f"[trainer_callback] sync v{sync.history[-1].version}: {what}", flush=True)

        callback.sync.after_sync.append(verify)
    trainer.add_callback(callback)
    trainer.train()
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0))
    summary: dict[str, Any] = {
        "steps": trainer.state.global_step,
        **callback.sync.summary(),
        "sampled": list(out[0].outputs[0].token_ids),
    }
    if args.verify:
        summary["all_verified"] = bool(VERIFIED) and all(VERIFIED) and len(VERIFIED) == summary["syncs"]
    callback.sync.detach()
    if rank == 0:
        print(json.dumps(summary), flush=True)
    dist.barrier()
    return 1 if args.verify and not summary["all_verified"] else 0


if __name__ == "__main__":
    sys.exit(main())
