"""For processes started by ``accelerate launch`` on CPU (the TRL benchmark; its environment is
``examples/cpu.py``'s ``colocated_cpu_env``).

- ``build_checkpoint(kind, path)``: a tiny or shaped checkpoint written by a clean child process: under
  accelerate's DeepSpeed launch, transformers' ``save_pretrained`` writes only part of a checkpoint (no
  config, no weights).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["build_checkpoint"]


def build_checkpoint(kind: str, path: str | os.PathLike[str]) -> Path:
    """``kind``: a tiny kind (``dense``, ...) or a shaped one (``qwen3-0.6b-shapes``); seed 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOCAL_", "RANK"))}
    code = (
        "import sys\n"
        "from testbed.shaped_models import SHAPED_KINDS, make_shaped_model\n"
        "from rollout_sync.tiny import make_tiny_model\n"
        "kind, path = sys.argv[1:]\n"
        "(make_shaped_model if kind in SHAPED_KINDS else make_tiny_model)(kind, path)\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, kind, str(path)], env=env, check=True, stdout=subprocess.DEVNULL
    )
    return Path(path)
