"""Steps shared by the end-to-end tests: a DeepSpeed job in a rank pool and a real vLLM engine, joined by
the handshake, synced after every optimizer step, and checked against the trainer's own checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankContext, RankPool, free_port
from testbed.trainer_ranks import attach, setup, train_step
from tests.harness.vllm_engines import DEFAULT_PROMPTS
from tests.vllm.rollout_checks import Snapshot, differing_params, snapshot
from vllm_plugin.driver import apply_checkpoint, connect_engine, receive_sync, setup_engines

TOKEN = "e2e-token"
TRAINER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def save_checkpoint(ctx: RankContext, out: str, model_dir: str) -> list[str]:
    """What ``save_pretrained`` writes, from DeepSpeed's own gathers (no rollout-sync map involved): every
    logical tensor under its checkpoint name, plus the model's config and tokenizer files. Collective."""
    from rollout_sync.trainer.reference import full_logical_tensors
    from rollout_sync.trainer.reference import save_checkpoint as write

    full = full_logical_tensors(ctx.state["engine"])
    if ctx.rank == 0:
        write(full, model_dir, out)
    return sorted(full)


def negate(ctx: RankContext, name: str, every: int = 67) -> int:
    """Negate every ``every``-th element of parameter ``name`` (a step prime to the row lengths of the tiny
    models, so every shard of it is reached) and nothing else: the one parameter a following delta sync
    finds changed. Under ZeRO-3 through ``GatheredParameters(modifier_rank=0)``, DeepSpeed's way to modify a
    partitioned parameter (a small one stays gathered: its partition and its gathered copy both change).
    Collective. Returns the elements negated."""
    import deepspeed
    import torch

    param = dict(ctx.state["engine"].module.named_parameters())[name]
    with torch.no_grad():
        if not hasattr(param, "ds_tensor"):
            chosen = param.data.view(-1)[::every]
            chosen.neg_()  # zeros become -0.0: a change of bits too
            return int(chosen.numel())
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            chosen = param.data.view(-1)[::every]
            if ctx.rank == 0:
                chosen.neg_()
            return int(chosen.numel())


@dataclass
class StepRecord:
    version: int
    trainer: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    synced: Snapshot
    reapplied: Snapshot
    checkpoint: Path


@dataclass
class E2ERun:
    ranks: list[int]
    steps: list[StepRecord] = field(default_factory=list)


def run_sync_steps(
    engine: Any,
    spec: DeepSpeedSpec,
    model: Path,
    out: Path,
    *,
    steps: int = 3,
    trainers: int = 2,
    policy: str = "balanced",
    timeout: float = 90.0,
    prepare: Callable[[Any], None] | None = None,
) -> E2ERun:
    """Train ``steps`` steps; after each, the hook syncs into ``engine`` (driven here, as a driver would);
    then the trainer's checkpoint is saved and written into the engine through vLLM's own loader maps: a
    sync that landed every element leaves every parameter unchanged by that write. ``prepare(engine)``
    runs after the engine's setup, before it joins."""
    with RankPool(trainers, env=TRAINER_ENV, timeout=600) as pool:
        pool.call(setup, spec, str(model))
        setup_engines([engine], first_rank=trainers)
        if prepare is not None:
            prepare(engine)
        address = f"tcp://127.0.0.1:{free_port()}"
        pending = pool.submit(attach, address, TOKEN, 1, 1, policy, timeout)
        connect_engine(engine, address, 0, token=TOKEN, timeout=timeout)
        run = E2ERun(ranks=pending.result(timeout * 2))
        for step in range(1, steps + 1):
            pending = pool.submit(train_step, step)
            workers = receive_sync([engine.llm])[0]
            trainer = pending.result(timeout * 2)
            assert engine.llm.get_weight_version() == str(trainer[0]["sync"]["version"])
            synced = snapshot(engine)
            checkpoint = out / f"step{step}"
            pool.call(save_checkpoint, str(checkpoint), str(model))
            apply_checkpoint([engine], str(checkpoint))
            reapplied = snapshot(engine)
            version = trainer[0]["sync"]["version"]
            run.steps.append(StepRecord(version, trainer, workers, synced, reapplied, checkpoint))
    return run


def check_steps(run: E2ERun) -> None:
    for i, rec in enumerate(run.steps, start=1):
        assert [t["sync"]["version"] for t in rec.trainer] == [rec.version] * len(rec.trainer), rec.trainer
        assert [w["version"] for w in rec.workers] == [rec.version] * len(rec.workers), rec.workers
        assert not any(w["incomplete"] for w in rec.workers)
        assert differing_params(rec.synced, rec.reapplied) == [], f"step {i}: parameters differ"
        assert rec.synced.tokens == rec.reapplied.tokens, f"step {i}"
    versions = [rec.version for rec in run.steps]
    assert versions == sorted(set(versions)), versions
    assert run.steps[0].synced.digests != run.steps[-1].synced.digests, "training changed nothing"


def fresh_engine_snapshot(
    pool: Any, checkpoint: Path, tp: int, *, packed: bool = False, **kwargs: Any
) -> Snapshot:
    """Greedy tokens and digests of a fresh engine started from ``checkpoint`` (its linear layers packed
    as ``pack`` does, with ``packed``)."""
    from tests.harness.vllm_engines import shared_spec

    fresh = pool.get(shared_spec(checkpoint, tp, **kwargs))
    try:
        if packed:
            pack(fresh)
        return snapshot(fresh)
    finally:
        pool.discard(fresh)


def pack(engine: Any) -> dict[str, int]:
    """The engine's dense linear layers kept in another form than they were loaded (an empty weight, a
    packed copy): by vLLM itself where this CPU packs (AVX-512/AMX), else by the contract stand-in
    (``testbed.packing``), so the same code path runs on every CPU. The engine must be discarded after."""
    before = engine.collective_rpc("rs_harness_packs")
    if any(p["empty_weight"] == 0 for p in before):
        engine.collective_rpc("rs_harness_pack_linears")
    after = engine.collective_rpc("rs_harness_packs")
    assert all(p["empty_weight"] == p["linears"] > 0 for p in after), after
    return {"linears": after[0]["linears"], "packed_by_vllm": before[0]["empty_weight"]}


__all__ = [
    "DEFAULT_PROMPTS",
    "E2ERun",
    "check_steps",
    "fresh_engine_snapshot",
    "negate",
    "pack",
    "run_sync_steps",
]
