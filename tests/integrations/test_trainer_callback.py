"""``RolloutSyncCallback`` in a plain ``transformers.Trainer`` with DeepSpeed ZeRO-3 on 2 CPU processes, each
holding its own vLLM engine (``external_launcher``): real transformers, accelerate, DeepSpeed and vLLM.

The README's command (``examples/trainer_callback.py --verify``): one sync when training begins, then one
per optimizer step (not per micro-batch: gradient accumulation 2 here), each checked bit for bit against
the trainer's weights as DeepSpeed gathers them and written through vLLM's own loader maps.
"""

from __future__ import annotations

import pytest

from tests.harness.accelerate_jobs import job_summary

pytest.importorskip("accelerate")

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]


def test_callback_syncs_at_train_begin_and_after_every_optimizer_step(tmp_path):
    out = job_summary(
        "examples/trainer_callback.py", 3, tmp_path, "--verify", "--steps", "3", "--grad-accum", "2"
    )
    assert out["steps"] == 3 and out["syncs"] == 4 and out["version"] == 3, out
    assert out["all_verified"], out
    # ZeRO-3 on 2 ranks: half in process, half to the other process's worker (messages, or mapped: same host)
    assert out["in_process_bytes"] > 0 and out["bytes_sent"] + out["mapped_bytes"] > 0, out
    assert len(out["sampled"]) == 4, out
