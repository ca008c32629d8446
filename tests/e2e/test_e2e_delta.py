"""Delta syncs end to end on CPU: a real DeepSpeed ZeRO-3 job (2 ranks, bf16, AdamW at lr 1e-5) and a real
vLLM engine (TP 2) whose dense linear layers are kept in another form than they were loaded (packed by vLLM
where this CPU packs, AVX-512/AMX; by the contract stand-in elsewhere), attached with ``delta=True``. Such
layers keep their loaded form between syncs (``vllm_plugin.loaded_form``: kept loaded forms), which is what
a delta applies on. The first sync is full; each later one applies on the last (every trainer rank and
worker names the same base) and moves only the changed elements (a few percent at this learning rate), and
the engine then holds exactly the trainer's weights: writing the trainer's own checkpoint changes no bit of
any parameter nor of any layer's loaded form, and greedy tokens equal a fresh engine loaded from it and
packed the same way. A weight update by other means (the checkpoint write) makes the next sync a full one,
and it too lands bit for bit. (Delta syncs into parameters vLLM keeps as loaded: ``tests/serve`` on a CPU
that keeps plain weights, and the executor tests.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankPool, free_port
from testbed.trainer_ranks import attach, setup, sync_now, train_step
from tests.e2e.e2e_steps import TOKEN, TRAINER_ENV, fresh_engine_snapshot, negate, pack, save_checkpoint
from tests.harness.vllm_engines import shared_spec
from tests.vllm.rollout_checks import differing_params, snapshot
from vllm_plugin.driver import apply_checkpoint, connect_engine, receive_sync, setup_engines

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]

TIMEOUT = 90.0


def _step(pool: RankPool, engine: Any, step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    pending = pool.submit(train_step, step)
    workers = receive_sync([engine.llm])[0]
    trainer = pending.result(TIMEOUT * 2)
    return trainer, workers


def _sync_now(pool: RankPool, engine: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A sync without a training step before it (the trainer's records shaped as ``_step``'s)."""
    pending = pool.submit(sync_now)
    workers = receive_sync([engine.llm])[0]
    return [{"sync": s} for s in pending.result(TIMEOUT * 2)], workers


def _stats(trainer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t["sync"]["stats"] for t in trainer]


def _bases(trainer: list[dict[str, Any]], workers: list[dict[str, Any]]) -> set[Any]:
    return {t["sync"]["stats"]["delta_base"] for t in trainer} | {w["stats"]["delta_base"] for w in workers}


@pytest.mark.parametrize("backend", ["gloo", "nixl"])
def test_delta_syncs_move_only_changed_weights_and_leave_the_engine_bit_exact(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path, backend: str
) -> None:
    """``nixl``: the same without a group, each worker reading only what each trainer rank coded for it into
    its export (``transport.nixl_delta``)."""
    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, 2))
    try:
        packs = pack(engine)
        with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
            pool.call(setup, DeepSpeedSpec("dense", 3, lr=1e-5), str(model))
            setup_engines([engine], first_rank=2)
            engine.collective_rpc("rollout_sync_record_loaded", args=(True,))
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = pool.submit(
                attach, address, TOKEN, 1, 1, "balanced", TIMEOUT, None, True, True, backend
            )
            connect_engine(engine, address, 0, token=TOKEN, timeout=TIMEOUT)
            pending.result(TIMEOUT * 2)
            steps = [_step(pool, engine, step) for step in range(1, 5)]
            versions = [t[0]["sync"]["version"] for t, _ in steps]
            assert _bases(*steps[0]) == {None}  # the first sync is full
            for k in range(1, len(steps)):
                assert _bases(*steps[k]) == {versions[k - 1]}, (k, steps[k])
            full_bytes = sum(  # the full sync's bytes: messages, or copied from mapped storages (same host)
                sum(t["sync"]["stats"]["bytes_sent"].values())
                + sum(t["sync"]["stats"]["bytes_mapped"].values())
                for t in steps[0][0]
            )
            for trainer, _ in steps[1:]:
                stats = [t["sync"]["stats"] for t in trainer]
                moved = sum(sum(s["bytes_sent"].values()) for s in stats)
                changed = sum(s["elements_changed"] for s in stats)
                compared = sum(s["elements_compared"] for s in stats)
                assert 0 < changed < 0.2 * compared, (changed, compared)
                assert moved < 0.2 * full_bytes, (moved, full_bytes)
                assert all(s["delta_state_bytes"] > 0 for s in stats)
            # Every packed layer keeps its loaded form (the delta's base): their memory is reported.
            kept = [w["loaded_forms"]["kept_bytes"] for _, workers in steps for w in workers]
            assert all(k > 0 for k in kept) and len(set(kept)) == 1, kept
            # The packing reads its input: after its first rebuild every layer gets its kept form itself.
            forms = [w["loaded_forms"] for _, workers in steps for w in workers]
            assert all(f["lent"] == 0 and f["rebuilt"] == packs["linears"] for f in forms[:2]), forms[:2]
            assert all(f["lent"] == f["rebuilt"] > 0 for f in forms[2:]), forms[2:]
            # Nothing changed since the last sync: every layer arrives unchanged, keeps its kernel's form
            # and nothing derived is rebuilt; then one parameter changes: only its layer is rebuilt.
            quiet = _sync_now(pool, engine)
            assert _bases(*quiet) == {versions[-1]}, quiet
            if backend == "gloo":  # a head per message
                assert all(sum(s["bytes_sent"].values()) == 16 * s["messages_sent"] for s in _stats(quiet[0]))
            else:  # a head per message, read from the export
                assert all(0 < sum(s["bytes_sent"].values()) < 0.01 * full_bytes for s in _stats(quiet[0]))
            forms = [w["loaded_forms"] for w in quiet[1]]
            assert all(f["rebuilt"] == 0 and f["unchanged"] == packs["linears"] for f in forms), forms
            assert all(w["refreshed"] == [] for w in quiet[1]), quiet[1]
            pool.call(negate, "model.layers.0.mlp.down_proj.weight")
            one = _sync_now(pool, engine)
            assert _bases(*one) == {quiet[0][0]["sync"]["version"]}, one
            forms = [w["loaded_forms"] for w in one[1]]
            assert all(f["rebuilt"] == 1 and f["unchanged"] == packs["linears"] - 1 for f in forms), forms
            assert all(w["refreshed"] == ["loaded form of model.layers.0.mlp.down_proj"] for w in one[1])
            synced = snapshot(engine)
            assert all(len(d) == packs["linears"] for d in synced.loaded), synced.loaded
            checkpoint = tmp_path / "step4"
            pool.call(save_checkpoint, str(checkpoint), str(model))
            apply_checkpoint([engine], str(checkpoint))
            written = snapshot(engine)
            assert differing_params(synced, written) == [], "the delta syncs missed an element"
            assert synced.loaded == written.loaded, "the delta syncs missed an element of a loaded form"
            # The checkpoint write was a weight update by other means: the next sync is full, and exact.
            trainer, workers = _step(pool, engine, 5)
            assert _bases(trainer, workers) == {None}
            synced = snapshot(engine)
            checkpoint = tmp_path / "step5"
            pool.call(save_checkpoint, str(checkpoint), str(model))
            apply_checkpoint([engine], str(checkpoint))
            written = snapshot(engine)
            assert differing_params(synced, written) == [] and synced.loaded == written.loaded
    finally:
        vllm_pool.discard(engine)  # packed
    fresh = fresh_engine_snapshot(vllm_pool, checkpoint, 2, packed=True)
    assert synced.tokens == fresh.tokens
    assert differing_params(synced, fresh) == []
