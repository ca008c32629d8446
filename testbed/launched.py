"""Helpers for processes started by ``accelerate launch`` on CPU (the TRL examples and benchmark).

- ``colocated_cpu_env()``: before vLLM is imported: offline Hugging Face, a small KV cache, and one core per
  process for its vLLM worker's OpenMP threads (each training process holds its own engine).
- ``build_checkpoint(kind, path)``: a tiny or shaped checkpoint written by a clean child process: under
  accelerate's DeepSpeed launch, transformers' ``save_pretrained`` writes only part of a checkpoint (no
  config, no weights).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["build_checkpoint", "colocated_cpu_env"]


def colocated_cpu_env() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cpus[local_rank % len(cpus)]))


def build_checkpoint(kind: str, path: str | os.PathLike[str]) -> Path:
    """``kind``: a tiny kind (``dense``, ...) or a shaped one (``qwen3-0.6b-shapes``); seed 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOCAL_", "RANK"))}
    code = (
        "import sys\n"
        "from testbed.shaped_models import SHAPED_KINDS, make_shaped_model\n"
        "from testbed.tiny_models import make_tiny_model\n"
        "kind, path = sys.argv[1:]\n"
        "(make_shaped_model if kind in SHAPED_KINDS else make_tiny_model)(kind, path)\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, kind, str(path)], env=env, check=True, stdout=subprocess.DEVNULL
    )
    return Path(path)
