"""TRL's GRPOTrainer with DeepSpeed ZeRO-3 and ZeRO-2, its weight sync replaced by rollout-sync, in colocate
and server mode: real TRL, real accelerate + DeepSpeed (2 CPU processes), real vLLM.

Each case runs the README's command (``accelerate launch --config_file examples/trl/zeroN.yaml
examples/trl_grpo.py --mode ... --verify``). After every sync the example gathers the trainer's weights
with DeepSpeed itself, writes them into vLLM through vLLM's own loader maps and checks that no bit of any
vLLM parameter changed; it exits non-zero otherwise. Here: every sync verified, one sync per global step
(TRL's step guard, also under gradient accumulation), and where the bytes went: in colocate mode the
pieces a process's own trainer rank stores reach its own vLLM worker in process (all of them under ZeRO-2,
about half under ZeRO-3 with 2 ranks); in server mode none do. Server mode also proves TRL's NCCL
communicator was never built: on a CPU it raises ``NotImplementedError``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from tests.harness.accelerate_jobs import job_summary, launch_job

pytest.importorskip("trl")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]

TRL_SERVER_ARGS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]


def launch_example(workdir: Path, zero: int, mode: str, *extra: str):
    return launch_job("examples/trl_grpo.py", zero, workdir, "--mode", mode, "--verify", *extra)


def run_example(workdir: Path, zero: int, mode: str, *extra: str) -> dict:
    return job_summary("examples/trl_grpo.py", zero, workdir, "--mode", mode, "--verify", *extra)


@contextlib.contextmanager
def served(tmp_path_factory, model: Path, name: str, extension: bool = True):
    """A TRL server mode ``vllm serve``; ``extension``: with rollout-sync's worker extension (the test
    extension, a subclass that adds the harness's workaround for vLLM's AMX bug: this server runs at TP 1,
    where a first prompt of a few tokens reaches AMX attention before any oneDNN AMX kernel)."""
    from tests.serve.servers import TEST_EXTENSION, launch, wait_all

    logs = tmp_path_factory.mktemp(name)
    srv = launch(model, logs, name, extra=TRL_SERVER_ARGS, extension=TEST_EXTENSION if extension else None)
    try:
        wait_all([srv])
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    with served(tmp_path_factory, tiny_model("dense"), "trl-server") as srv:
        yield srv


@pytest.mark.parametrize("zero", [3, 2])
def test_colocate(tmp_path, zero):
    out = run_example(tmp_path, zero, "colocate", "--steps", "3")
    assert out["all_verified"] and out["syncs"] == 3 and out["verified"] == 3, out
    assert out["engines"] == 2 and out["version"] == 2, out
    if zero == 2:  # each rank holds a whole replica: its own worker copies everything in process
        assert out["in_process_bytes"] > 0 and out["bytes_sent"] == out["mapped_bytes"] == 0, out
    else:  # each rank holds half of every tensor: the other half goes to the other process's worker (as
        # messages, or copied by it from this process's storages where it maps them: same host)
        assert out["in_process_bytes"] > 0 and out["bytes_sent"] + out["mapped_bytes"] > 0, out


@pytest.mark.parametrize("zero", [3, 2])
def test_colocate_with_a_peft_adapter_syncs_the_merged_weights(tmp_path, zero):
    """GRPO with ``peft_config`` (LoRA on every linear layer): TRL's engines have no LoRA, so each sync sends
    the base weights merged with the adapter, each rank merging what it stores; after every sync, writing
    PEFT's own ``merge_and_unload`` of DeepSpeed's gathered weights into vLLM changes no bit."""
    out = run_example(tmp_path, zero, "colocate", "--steps", "2", "--peft")
    assert out["all_verified"] and out["syncs"] == 2 and out["verified"] == 2, out


def test_colocate_gradient_accumulation(tmp_path):
    """Two micro-batches per optimizer step: still one sync per global step (TRL's step guard)."""
    out = run_example(tmp_path, 3, "colocate", "--steps", "2", "--grad-accum", "2")
    assert out["all_verified"] and out["syncs"] == 2 and out["version"] == 1, out


@pytest.mark.parametrize("zero", [3, 2])
def test_server(tmp_path, server, tiny_model, zero):
    url = server.engine.url
    out = run_example(tmp_path, zero, "server", "--steps", "3", "--server-url", url)
    assert out["all_verified"] and out["syncs"] == 3 and out["verified"] == 3, out
    assert out["engines"] == 1 and out["in_process_bytes"] == 0, out
    assert out["bytes_sent"] + out["mapped_bytes"] > 0, out  # messages, or mapped (same host)
    assert server.engine.weight_version() == str(out["version"])


def test_server_with_a_peft_adapter_syncs_the_merged_weights(tmp_path, server):
    out = run_example(tmp_path, 3, "server", "--steps", "2", "--server-url", server.engine.url, "--peft")
    assert out["all_verified"] and out["syncs"] == 2 and out["verified"] == 2, out
    assert server.engine.weight_version() == str(out["version"])


def test_server_without_the_extension_is_refused_on_every_rank(tmp_path_factory, tmp_path, tiny_model):
    """A server started without rollout-sync's worker extension: every training process raises the same
    typed error naming the server and the cause at the first sync, before any rank joins a sync group."""
    with served(tmp_path_factory, tiny_model("dense"), "trl-bare-server", extension=False) as bare:
        proc = launch_example(tmp_path, 3, "server", "--steps", "1", "--server-url", bare.engine.url)
        log = proc.stdout + proc.stderr
        assert proc.returncode != 0, log[-3000:]
        for rank in (0, 1):
            refusal = (
                f"[rank{rank}]: rollout_sync.errors.UnsupportedLayoutError: the vLLM side cannot take part"
            )
            assert refusal in log, log[-6000:]
        assert "training process 0: PeerFailedError" in log and bare.engine.url in log, log[-6000:]
        assert "sync v0" not in log  # nothing was synced, nothing verified
