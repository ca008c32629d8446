"""Training jobs under ``accelerate launch`` (DeepSpeed on 2 CPU processes), as the README runs them, from
outside the checkout (``tests.harness.examples``): each job's working directory is its ``WORKDIR``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness.examples import example_env
from tests.harness.vllm_engines import REPO_ROOT


def job_command(script: str, zero: int, workdir: Path, *args: str) -> list[str]:
    """``accelerate launch --config_file examples/trl/zero{zero}.yaml SCRIPT --workdir WORKDIR ARGS``."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO_ROOT / "examples" / "trl" / f"zero{zero}.yaml"),
        str(REPO_ROOT / script),
        "--workdir",
        str(workdir),
        *args,
    ]


def launch_job(script: str, zero: int, workdir: Path, *args: str, timeout: float = 600.0):
    """``job_command``, run in ``WORKDIR``; the output is kept in ``WORKDIR/run.log``."""
    cmd = job_command(script, zero, workdir, *args)
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        cmd, cwd=workdir, env=example_env(), capture_output=True, text=True, timeout=timeout
    )
    (workdir / "run.log").write_text(proc.stdout + proc.stderr)
    return proc


def job_summary(script: str, zero: int, workdir: Path, *args: str) -> dict[str, Any]:
    """Run a job that must succeed; its last JSON line (process 0's summary)."""
    proc = launch_job(script, zero, workdir, *args)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{log[-6000:]}"
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    return json.loads(last)
