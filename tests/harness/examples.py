"""Running the examples as a user would: from outside the checkout, with rollout-sync coming from its install.

``example_env(**extra)`` is this process's environment without ``PYTHONPATH`` (so nothing of the checkout,
``testbed`` included, is importable), with ``DS_ACCELERATOR=cpu`` and ``extra``. Run the example by its
absolute path from a working directory outside the checkout (``tmp_path``).
"""

from __future__ import annotations

import os
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DS_ACCELERATOR"] = "cpu"
    env.update(extra)
    return env
