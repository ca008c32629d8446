"""Real ``vllm serve`` servers on loopback for tests, started through ``python -m vllm_plugin.serve``.

Each server runs in its own session (process group), so that stopping it ends its engine core and workers
too; ``stop`` waits for the group to be gone and kills it by id if it is not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from testbed.rank_pool import free_port
from tests.harness.vllm_engines import REPO_ROOT, omp_threads_bind
from vllm_plugin.http_driver import ServerEngine

EXTENSION = "vllm_plugin.extension.RolloutSyncExtension"
#: The product's extension plus the test tools (``tests.harness.vllm_ext``), for servers that need them.
TEST_EXTENSION = "tests.harness.vllm_ext.TestWorkerExtension"


WEIGHT_TRANSFER = ["--weight-transfer-config", '{"backend": "rollout_sync"}']


def serve_command(
    model: Path | str,
    port: int,
    tp: int = 1,
    extra: Sequence[str] = (),
    extension: str | None = EXTENSION,
    host: str = "127.0.0.1",
) -> list[str]:
    """The exact command the README documents (plus the test's small-memory settings); ``extra``: more
    arguments for ``vllm serve`` (``WEIGHT_TRANSFER``); ``extension``: the worker extension class
    (``TEST_EXTENSION`` adds the test tools; None: a server without rollout-sync's worker extension, for
    refusal tests); ``host``: the address it listens on."""
    return [
        sys.executable,
        "-m",
        "vllm_plugin.serve",
        "serve",
        str(model),
        *(["--worker-extension-cls", extension] if extension else []),
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(64 * 2**20),
        "--seed",
        "0",
        *extra,
    ]


@dataclass
class Server:
    engine: ServerEngine
    proc: subprocess.Popen[bytes]
    log: Path
    log_file: IO[Any]
    extension: str | None = EXTENSION
    tp: int = 1

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + timeout
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log_file.close()

    def kill(self) -> None:
        """Kill the server and every process of its group at once (fault tests)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def launch(
    model: Path | str,
    log_dir: Path,
    name: str,
    tp: int = 1,
    extra: Sequence[str] = (),
    extension: str | None = EXTENSION,
) -> Server:
    port = free_port()
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind(tp))
    log = log_dir / f"{name}.log"
    log_file = open(log, "wb")  # noqa: SIM115 - closed by Server.stop
    proc = subprocess.Popen(
        serve_command(model, port, tp, extra, extension),
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=REPO_ROOT,
    )
    engine = ServerEngine(f"http://127.0.0.1:{port}", name=name, timeout=120.0)
    return Server(engine, proc, log, log_file, extension, tp)


def wait_all(servers: list[Server], timeout: float = 300.0) -> list[float]:
    """Wait until every server answers ``/health``; a server that exits first fails with its log's tail.
    A server with the test tools then gets the harness's workaround for vLLM's AMX bug
    (``TestWorkerExtension.rs_harness_request_amx``) before anything generates."""
    start = time.monotonic()
    waited = []
    for server in servers:
        while True:
            if server.proc.poll() is not None:
                tail = server.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"server {server.engine.name} exited ({server.proc.returncode}):\n{tail}")
            try:
                server.engine.request("/health", timeout=5.0)
                break
            except Exception:
                if time.monotonic() - start > timeout:
                    raise
                time.sleep(1.0)
        if server.extension == TEST_EXTENSION:
            server.engine.request("/collective_rpc", {"method": "rs_harness_request_amx"}, timeout=60.0)
        if server.tp > 1:
            # The first completion at TP > 1 compiles the vocab-parallel embedding's mask (vLLM's
            # torch.compile, a C++ compiler): over 2 minutes on a loaded machine with a cold compile cache (CI).
            # Done here, within the start-up budget, not inside a test's request limit.
            first = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            left = max(timeout - (time.monotonic() - start), 120.0)
            server.engine.request("/v1/completions", first, timeout=left)
        waited.append(time.monotonic() - start)
    return waited
