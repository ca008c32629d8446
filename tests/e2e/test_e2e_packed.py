"""Layers vLLM keeps in another form than it loaded them: a DeepSpeed ZeRO-3 job syncs into a TP-2 engine
whose dense linear layers hold an empty weight and compute from a packed copy.

Where this CPU packs (vLLM's oneDNN / sgl GEMM dispatch on AVX-512/AMX CPUs leaves an empty weight), the
engine's own packed layers are used. Where vLLM keeps plain weights (AVX2), the contract stand-in
(``tests/harness/vllm_ext.py``: ``StandInPacking``) packs them the same way first, and the product takes
the same path. Either way the test runs: it is never skipped.

Setup probes the packed layers' loaded form: the maps equal the pure builders'. Checked at every step: every layer's loaded form, as the sync wrote it, equals (digest) what a write of the
trainer's own checkpoint (DeepSpeed's gathers, not our maps' sources) writes, before vLLM processes it; the
layers are rebuilt (weights empty again, tokens as after the checkpoint write). After the last step: greedy
tokens and every raw logit of every vocabulary entry equal a fresh engine started from the trainer's
checkpoint and packed the same way. A partial write of a packed layer is refused and leaves it as it was; a
packed layer nothing can rebuild is refused at setup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout_sync.errors import IncompleteUpdateError, PeerFailedError
from testbed.deepspeed import DeepSpeedSpec
from tests.e2e.e2e_steps import check_steps, pack, run_sync_steps
from tests.harness.vllm_engines import LOGITS_KWARGS, shared_spec
from tests.vllm.rollout_checks import builder_differences
from vllm_plugin.driver import setup_engines

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]


def test_zero3_syncs_into_packed_linear_layers_through_their_loaded_form(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path
):
    model = tiny_model("dense")
    spec = shared_spec(model, 2, **LOGITS_KWARGS)
    engine = vllm_pool.get(spec)
    seen: dict[str, Any] = {}

    def prepare(e: Any) -> None:
        seen["layers"] = e.collective_rpc("rollout_sync_record_loaded", args=(True,))
        seen["summary"] = e.collective_rpc("rollout_sync_summary")

    try:
        packs = pack(engine)
        # Setup learns the loaded form of the packed layers: the probed maps equal the pure builders'.
        probed = setup_engines([engine], first_rank=2).maps
        run = run_sync_steps(engine, DeepSpeedSpec("dense", 3), model, tmp_path, steps=2, prepare=prepare)
        synced_logits = engine.logits()
        # A write that leaves a packed layer incomplete is refused; the layer keeps its weights. (Through
        # rollout_sync_call, which answers an error instead of raising it: vLLM's collective_rpc leaves
        # the other workers' failed replies queued for the next call at TP 2.)
        partial = [str(run.steps[0].checkpoint), ["model.layers.0.self_attn.q_proj.weight"]]
        replies = engine.collective_rpc(
            "rollout_sync_call", kwargs={"method": "apply_checkpoint", "nonce": "partial", "args": partial}
        )
        assert all(IncompleteUpdateError.__name__ in r.get("error", "") for r in replies), replies
        assert all("model.layers.0.self_attn.qkv_proj" in r["error"] for r in replies), replies
        after_refusal = engine.generate_greedy()
        assert engine.collective_rpc("rs_harness_packs")[0]["empty_weight"] == packs["linears"]
        # A packed layer nothing can rebuild (no quant method) is refused at setup, named, with the reason.
        engine.collective_rpc("rs_harness_drop_quant_method", args=("model.layers.1.mlp.down_proj",))
        with pytest.raises(
            PeerFailedError, match=r"UnsupportedLayoutError.*model\.layers\.1\.mlp\.down_proj.*quant"
        ):
            setup_engines([engine], first_rank=2)
    finally:
        vllm_pool.discard(engine)

    # Every linear layer of every worker is written in its loaded form (q, k, v land in qkv_proj; gate and
    # up in gate_up_proj), and the summary says how big the largest one is.
    assert seen["layers"] == [packs["linears"]] * 2, seen["layers"]
    for summary in seen["summary"]:
        assert summary["loaded_form_layers"] == packs["linears"]
        assert summary["largest_layer_loaded_bytes"] > 0
    assert builder_differences(probed, model, 1, 2, 2) == []
    check_steps(run)
    for rec in run.steps:
        assert all(rec.synced.loaded), "no loaded form was recorded"
        assert rec.synced.loaded == rec.reapplied.loaded, f"step {rec.version}: loaded forms differ"
        assert all(len(d) == packs["linears"] for d in rec.synced.loaded)
    assert run.steps[0].synced.loaded != run.steps[-1].synced.loaded, "training changed no loaded form"
    assert after_refusal == run.steps[-1].synced.tokens

    fresh = vllm_pool.get(shared_spec(run.steps[-1].checkpoint, 2, **LOGITS_KWARGS))
    try:
        pack(fresh)
        fresh_tokens = fresh.generate_greedy()
        fresh_logits = fresh.logits()
    finally:
        vllm_pool.discard(fresh)
    assert run.steps[-1].synced.tokens == fresh_tokens
    assert synced_logits == fresh_logits
    assert len(synced_logits[0][0]) > 100  # every vocabulary entry, not a top-k
