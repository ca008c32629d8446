"""What the examples need on a CPU machine.

- ``init_distributed()`` and ``build_engine(model, ...)``: a DeepSpeed rank on CPU (gloo), from the launcher's
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
- ``colocated_cpu_env()``: call before vLLM is imported: offline Hugging Face, a small KV cache, and one core
  per process for its vLLM worker's OpenMP threads (each training process holds its own engine).
- ``tiny_checkpoint(kind, path)``: a tiny Qwen3 made locally (``python -m rollout_sync.tiny``), in a clean
  child process: under accelerate's DeepSpeed launch, transformers' ``save_pretrained`` writes only part of
  a checkpoint (no config, no weights).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["build_engine", "colocated_cpu_env", "init_distributed", "tiny_checkpoint"]


def init_distributed() -> None:
    """DeepSpeed's process group over gloo. On CPU, DeepSpeed's comm backend JIT-compiles a shared-memory op
    when it starts (about a minute, the first time on a machine) that serves only inference all-reduce;
    training goes through gloo either way, so the build is skipped, as DeepSpeed itself does where the op is
    not compatible."""
    import importlib

    import deepspeed

    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def build_engine(model: str, *, zero: int = 3, lr: float = 1e-3, autotp: int = 1, autoep: int = 1) -> Any:
    """The checkpoint in bf16 under DeepSpeed: ZeRO stage ``zero``, AutoTP ``autotp``, AutoEP ``autoep`` (a
    Qwen3-MoE). On CPU the optimizer is torch's AdamW (``torch_adam``): DeepSpeed's own AdamW would
    JIT-compile FusedAdam first."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 2**31 - 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": zero},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
    }
    if autotp > 1:
        config["tensor_parallel"] = {"autotp_size": autotp}
    if autoep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": autoep, "preset_model": "qwen3_moe"}
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    return engine


def colocated_cpu_env() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cpus[local_rank % len(cpus)]))


def tiny_checkpoint(kind: str, path: str | os.PathLike[str]) -> Path:
    """A tiny checkpoint of ``kind`` (``dense``, ``dense-tied``, ``moe``) at ``path``, seed 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOCAL_", "RANK"))}
    cmd = [sys.executable, "-m", "rollout_sync.tiny", kind, str(path)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return Path(path)
