"""TRL's GRPOTrainer in server mode with the vLLM server on another host (``testbed.hosts``): the training
job (``accelerate launch``, DeepSpeed ZeRO-3 on 2 processes) on host a names only the server's URL; the
coordinator's address is derived from the route to the server, and the server's workers connect back to
it. Every sync verified bit for bit (``examples/trl_grpo.py --verify``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testbed.hosts import Hosts
from tests.harness.accelerate_jobs import job_command
from tests.harness.examples import example_env
from tests.serve.servers import TEST_EXTENSION, serve_command

pytest.importorskip("trl")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.deepspeed,
]

ROOT = Path(__file__).resolve().parents[2]
TRL_SERVER_ARGS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
# From host a: wait for the server on host b, then the harness's workaround for vLLM's AMX bug on it
# (tests.serve.servers.wait_all does the same for servers on this host).
READY = """
import sys, time
from vllm_plugin.http_driver import ServerEngine
engine = ServerEngine(sys.argv[1], name="server", timeout=60.0)
deadline = time.monotonic() + 400
while True:
    try:
        engine.request("/health", timeout=5.0)
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(1.0)
engine.request("/collective_rpc", {"method": "rs_harness_request_amx"}, timeout=60.0)
"""


def test_trl_server_mode_syncs_into_a_server_on_another_host_bit_for_bit(tiny_model: Any, tmp_path: Path):
    model = tiny_model("dense")
    # the server runs a test extension (the checkout on PYTHONPATH); the job is the example, run as a user would
    server_env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_SERVER_DEV_MODE": "1", "DS_ACCELERATOR": "cpu"}
    env = example_env(VLLM_SERVER_DEV_MODE="1")
    with Hosts(["a", "b"]) as hosts:
        url = f"http://{hosts.name_of('b')}:8000"
        serve = serve_command(model, 8000, 1, TRL_SERVER_ARGS, TEST_EXTENSION, host=hosts.address("b"))
        server = hosts.run("b", serve, env=server_env, cwd=ROOT, stdout=(tmp_path / "server.log").open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        try:
            hosts.exec("a", [sys.executable, "-c", READY, url], timeout=460)
        except Exception:
            raise AssertionError((tmp_path / "server.log").read_text(errors="replace")[-3000:]) from None
        before = hosts.bytes_into("b")
        cmd = job_command("examples/trl_grpo.py", 3, tmp_path, "--mode", "server", "--verify", "--steps", "3")
        job = hosts.run("a", [*cmd, "--server-url", url], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        out, _ = job.communicate(timeout=600)
        crossed = hosts.bytes_into("b") - before
        Hosts.stop(server)
    log = out.decode(errors="replace")
    (tmp_path / "run.log").write_text(log)
    assert job.returncode == 0, log[-6000:]
    summary = json.loads([line for line in log.splitlines() if line.startswith("{")][-1])
    assert summary["all_verified"] and summary["syncs"] == 3 and summary["verified"] == 3, summary
    assert summary["bytes_sent"] > 0 and summary["in_process_bytes"] == summary["mapped_bytes"] == 0, summary
    assert crossed > summary["bytes_sent"], (crossed, summary)
