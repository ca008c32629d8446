"""LoRA adapters end to end on CPU: a PEFT model under real DeepSpeed (2 trainer ranks) syncs only its
adapter into a LoRA slot of a real vLLM engine (``enable_lora``), after every optimizer step. After each sync
the engine, asked for the synced adapter by name, gives the same greedy tokens and the same raw logits, bit
for bit, as the same engine loading that step's adapter from the PEFT checkpoint DeepSpeed's own gathers
wrote (``LoRARequest`` with its path); and neither equals the base model. The base weights never move."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.trainer.adapter import adapter_config
from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankContext, RankPool, free_port
from testbed.trainer_ranks import attach, setup, sync_now, train_step
from tests.e2e.e2e_steps import TOKEN, TRAINER_ENV
from tests.harness.vllm_engines import DEFAULT_PROMPTS, LOGITS_KWARGS, shared_spec
from tests.vllm.rollout_checks import differing_params, snapshot
from vllm_plugin.driver import apply_checkpoint, connect_engine, receive_sync, setup_engines

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]

RANK = 8
LORA = {"r": RANK, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
ENGINE = {**LOGITS_KWARGS, "enable_lora": True, "max_lora_rank": RANK, "max_loras": 2}
SYNCED_ID = 1


def _save_adapter(ctx: RankContext, out: str) -> list[str]:
    from rollout_sync.trainer.reference import save_adapter

    return save_adapter(ctx.state["engine"], out)


def _outputs(llm: Any, request: Any) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Greedy tokens and every raw logit of each generated position, under ``request`` (None: base)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=-1)
    # one prompt per call: which requests share a step (the GEMMs' row counts, hence their last bits) must
    # not depend on when each request reached the engine
    outs = [
        llm.generate([{"prompt_token_ids": list(p)}], params, lora_request=request, use_tqdm=False)[0]
        for p in DEFAULT_PROMPTS
    ]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logits = [[[v.logprob for _, v in sorted(pos.items())] for pos in o.outputs[0].logprobs] for o in outs]
    return tokens, logits


@pytest.mark.parametrize(
    ("stage", "tp", "sharded", "backend", "delta"),
    [
        (3, 2, False, "gloo", False),
        (3, 2, True, "gloo", False),
        (2, 1, False, "gloo", False),
        # ZeRO-1 with delta=True: Adam moves most of B at every step, so each trainer rank's sample sends a
        # full sync; what is checked is that the delta machinery keeps the adapter exact
        (1, 2, False, "gloo", True),
        (3, 2, False, "nixl", False),  # group-free: the workers read the adapter from the trainer ranks
    ],
    ids=["zero3-tp2", "zero3-tp2-fully-sharded", "zero2-tp1", "zero1-tp2-delta", "zero3-tp2-nixl"],
)
def test_a_peft_adapter_syncs_into_a_lora_slot_and_serves_as_its_peft_checkpoint_would(
    tiny_model: Any,
    vllm_pool: Any,
    tmp_path: Path,
    stage: int,
    tp: int,
    sharded: bool,
    backend: str,
    delta: bool,
):
    from vllm.lora.request import LoRARequest

    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, tp, **ENGINE, fully_sharded_loras=sharded))
    timeout = 90.0
    try:
        with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
            pool.call(setup, DeepSpeedSpec("dense", stage, lora=LORA), str(model))
            spec = adapter_config({"default": {"peft_type": "LORA", **LORA}}).spec("policy", SYNCED_ID)
            reports: list[list[dict[str, Any]]] = []
            setup_engines([engine], first_rank=2, lora=spec, reports=reports)
            assert all(w["refused"] == {} for w in reports[0]), reports
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = pool.submit(
                attach, address, TOKEN, 1, 1, "balanced", timeout, None, True, delta, backend
            )
            connect_engine(engine, address, 0, token=TOKEN, timeout=timeout)
            pending.result(timeout * 2)
            base = _outputs(engine.llm, None)
            for step in range(1, 4):
                pending = pool.submit(train_step, step)
                workers = receive_sync([engine.llm])[0]
                trainer = pending.result(timeout * 2)
                version = trainer[0]["sync"]["version"]
                assert [w["version"] for w in workers] == [version] * tp, workers
                stats = [t["sync"]["stats"] for t in trainer]
                sent = sum(sum(s["bytes_sent"].values()) + sum(s["bytes_mapped"].values()) for s in stats)
                stored = _stored_bytes(RANK, model, 1 if sharded else tp)
                if delta and step > 1:  # what changed since the last sync, or all of it (a full sync)
                    assert 0 < sent <= stored, f"step {step}: {sent} bytes sent, the workers store {stored}"
                else:
                    assert sent == stored, f"step {step}: {sent} bytes sent, the workers store {stored}"
                saved = tmp_path / f"adapter-{step}"
                pool.call(_save_adapter, str(saved))
                synced = _outputs(engine.llm, LoRARequest("policy", SYNCED_ID, "never-read"))
                loaded = _outputs(engine.llm, LoRARequest(f"peft-{step}", 100 + step, str(saved)))
                assert synced[0] == loaded[0], f"step {step}: tokens differ"
                assert synced[1] == loaded[1], f"step {step}: logits differ"
                assert synced[1] != base[1], f"step {step}: the adapter changes nothing"
    finally:
        vllm_pool.discard(engine)  # a slot stays pinned to the synced adapter


def _stored_bytes(rank: int, model: Path, copies: int) -> int:
    """Bytes (bf16) of A and B that the engine's workers store together: by default vLLM keeps a
    column-parallel layer's A (``q/k/v/gate/up_proj``) and a row-parallel layer's B (``o/down_proj``) whole
    on each of its ``copies`` TP ranks and splits the other by TP (with ``fully_sharded_loras`` it splits
    both: ``copies`` 1). Each of those elements moves once, from the trainer rank that stores it."""
    from rollout_sync.rollout.checkpoint import logical_tensors

    total = 0
    for name, (shape, _) in logical_tensors(model).items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            continue
        out, inp = shape
        row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
        a, b = rank * inp, out * rank
        total += 2 * (a + b * copies if row_parallel else a * copies + b)
    return total


def _sync_on_rank_0_only(ctx: RankContext, version: int) -> str | None:
    """Trainer rank 0 syncs ``version``; rank 1 sends nothing (as if it died): rank 0's error, or None."""
    if ctx.rank != 0:
        return None
    try:
        ctx.state["sync"].sync(version)
    except Exception as exc:
        return type(exc).__name__
    return None


def test_a_failed_adapter_sync_leaves_the_previous_adapter_serving(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path
):
    """A sync one trainer rank never sends (as if it died before its step's sync): it fails within the
    timeout on both sides, the engine keeps its version, and the adapter it serves gives the tokens and
    logits of the last complete sync. (Here nothing lands before the failure, atomic worker or not; a
    failure after part of a sync landed is what ``atomic=True`` covers, as for weights: the worker receives
    into copies and writes the slot, B's staging and its scaled copy only after the commit.)"""
    from vllm.lora.request import LoRARequest

    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, 1, **ENGINE))
    timeout = 15.0
    try:
        with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
            pool.call(setup, DeepSpeedSpec("dense", 3, lora=LORA), str(model))
            spec = adapter_config({"default": {"peft_type": "LORA", **LORA}}).spec("policy", SYNCED_ID)
            setup_engines([engine], first_rank=2, lora=spec)
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = pool.submit(attach, address, TOKEN, 1, None, "balanced", timeout)
            connect_engine(engine, address, 0, token=TOKEN, timeout=timeout, atomic=True)
            pending.result(timeout * 2)
            request = LoRARequest("policy", SYNCED_ID, "never-read")
            pool.call(train_step, 1)
            pending = pool.submit(sync_now, 1)
            receive_sync([engine.llm])
            pending.result(timeout * 2)
            good = _outputs(engine.llm, request)
            pool.call(train_step, 2)
            pending = pool.submit(_sync_on_rank_0_only, 2)
            started = time.monotonic()
            with pytest.raises(Exception, match=r"SyncTimeoutError|PeerFailedError|timed out"):
                receive_sync([engine.llm])
            assert time.monotonic() - started < timeout * 3
            assert pending.result(timeout * 4)[0] is not None, (
                "trainer rank 0 claimed a sync rank 1 never sent"
            )
            assert engine.llm.get_weight_version() == "1"
            assert _outputs(engine.llm, request) == good
    finally:
        vllm_pool.discard(engine)


def _save_merged(ctx: RankContext, out: str, model_dir: str) -> None:
    from rollout_sync.trainer.reference import save_merged

    save_merged(ctx.state["engine"], model_dir, out)


@pytest.mark.parametrize(("stage", "tp"), [(3, 2), (2, 1)])
def test_a_merged_sync_gives_an_engine_without_lora_peft_s_merge_and_unload_bit_for_bit(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path, stage: int, tp: int
):
    """``lora="merged"``: each trainer rank merges the base storage it holds with the (gathered) A and B and
    sends that; after every sync, writing PEFT's own ``merge_and_unload`` of DeepSpeed's gathered weights
    into the engine through vLLM's loaders changes no bit, and the greedy tokens are those of the base
    model changed by the adapter."""
    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, tp))
    timeout = 90.0
    try:
        with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
            pool.call(setup, DeepSpeedSpec("dense", stage, lora=LORA), str(model))
            setup_engines([engine], first_rank=2)
            # where vLLM packs its linear layers (AVX-512, AMX) their weights are empty: digest the loaded
            # form each write makes instead (none where it keeps plain weights)
            packed = engine.collective_rpc("rollout_sync_record_loaded", args=(True,))[0]
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = pool.submit(
                attach, address, TOKEN, 1, 1, "balanced", timeout, None, True, False, "gloo", "merged"
            )
            connect_engine(engine, address, 0, token=TOKEN, timeout=timeout)
            pending.result(timeout * 2)
            base = snapshot(engine)
            for step in range(1, 3):
                pending = pool.submit(train_step, step)
                workers = receive_sync([engine.llm])[0]
                trainer = pending.result(timeout * 2)
                assert [w["version"] for w in workers] == [trainer[0]["sync"]["version"]] * tp
                synced = snapshot(engine)
                merged = tmp_path / f"merged-{step}"
                pool.call(_save_merged, str(merged), str(model))
                apply_checkpoint([engine], str(merged))
                reapplied = snapshot(engine)
                assert differing_params(synced, reapplied) == [], f"step {step}: PEFT's merge differs"
                assert synced.loaded == reapplied.loaded, f"step {step}: a packed layer differs"
                assert all(len(d) == packed for d in synced.loaded)
                assert synced.tokens == reapplied.tokens
                assert synced.tokens != base.tokens, f"step {step}: the merge changed nothing"
    finally:
        vllm_pool.discard(engine)  # it records loaded forms


def test_what_an_engine_cannot_serve_is_refused_at_setup_and_a_mismatched_adapter_at_the_handshake(
    tiny_model: Any, vllm_pool: Any
):
    """Refused before any byte moves, naming what was wrong: a rank above the engine's ``max_lora_rank`` and a
    target module it does not serve as LoRA (at setup, on every worker); an engine set up for another
    scaling than the trainer's adapter (at the handshake, on every rank)."""
    from rollout_sync.errors import PeerFailedError

    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, 1, **ENGINE))
    spec = adapter_config({"default": {"peft_type": "LORA", **LORA}}).spec("policy", SYNCED_ID)
    try:
        with pytest.raises(PeerFailedError, match="max_lora_rank"):
            setup_engines([engine], first_rank=2, lora={**spec, "rank": 2 * RANK})
        with pytest.raises(PeerFailedError, match=r"does not serve as LoRA.*'lm_head'"):
            setup_engines([engine], first_rank=2, lora={**spec, "target_modules": ["o_proj", "lm_head"]})
        with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
            pool.call(setup, DeepSpeedSpec("dense", 2, lora=LORA), str(model))
            setup_engines([engine], first_rank=2, lora={**spec, "scaling": 1.0})
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = pool.submit(attach, address, TOKEN, 1, 1, "balanced", 30.0)
            with pytest.raises(PeerFailedError, match="another LoRA adapter"):
                connect_engine(engine, address, 0, token=TOKEN, timeout=30.0)
            with pytest.raises(Exception, match="another LoRA adapter"):
                pending.result(60)
    finally:
        vllm_pool.discard(engine)
