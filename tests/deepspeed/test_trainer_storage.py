"""Trainer storage maps of live DeepSpeed engines (CPU, gloo), checked bit for bit.

One engine launch per configuration covers every check of that configuration:

1. rank 0 builds the maps alone while the other ranks wait at a barrier (a hidden collective would hang),
   and the maps equal what every rank builds afterwards;
2. before any step, every rank's storage views equal its pieces of the checkpoint the engine loaded;
3. after a training step (the views are the engine's own buffers), its views equal its pieces of
   DeepSpeed's own gathers, for the parameters and, under ZeRO-1/2/3, the fp32 master weights and Adam's
   ``exp_avg`` / ``exp_avg_sq``;
4. a plan from the trainer maps into a vLLM-style layout over the same ranks (TP over every rank), executed
   into NaN-filled targets, reproduces every logical tensor exactly, from the parameters and from the
   fp32 master weights into bf16 targets;
5. the dry runs give the same maps from the model config and the layout description alone: the map
   builders' ``rollout_sync.shapes.trainer_maps`` (parameters, where it models the configuration) and
   ``rollout_sync.trainer.shape_facts.dry_run_facts`` (every state).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from trainer_helpers import checkpoint_tensors, compare_views, full_tensors, run_engines, same_bits, timed

from rollout_sync.geometry import trainer_maps, vllm_target_maps
from rollout_sync.layout.maps import TensorMap
from rollout_sync.planning.planner import plan_model
from rollout_sync.shapes import model_tensors
from rollout_sync.trainer import state_maps, trainer_storage, trainer_storages
from rollout_sync.trainer.shape_facts import dry_run_facts
from testbed.expected_storage import extract
from tests.harness.deepspeed_engines import DeepSpeedRank, DeepSpeedSpec, train_step

pytestmark = pytest.mark.deepspeed

OPT_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _sync_into_fresh_targets(
    ctx: DeepSpeedRank,
    sources: list[TensorMap],
    views: dict[str, torch.Tensor],
    target_dtype: str,
    full: dict[str, torch.Tensor],
) -> list[str]:
    """Plan sources -> a vLLM TP layout over every rank, execute into NaN targets, compare to ``full``."""
    import json

    from rollout_sync.transport import ExecuteOptions, Executor

    config = json.loads((ctx.model_path / "config.json").read_text())
    targets = vllm_target_maps(model_tensors(config), 1, ctx.world_size, 1, 0, target_dtype)
    plan = plan_model(sources, targets)
    dtype = getattr(torch, target_dtype)
    buffers = {
        t.name: torch.full(t.ranks[ctx.rank].shape, float("nan"), dtype=dtype)
        for t in targets
        if ctx.rank in t.ranks
    }
    Executor(ctx.group, ExecuteOptions(timeout=60)).execute(plan.half(ctx.rank), views, buffers)
    wrong = []
    for t in targets:
        if ctx.rank not in t.ranks:
            continue
        expected = extract(full[t.name].to(dtype), t, ctx.rank)
        if not same_bits(expected, buffers[t.name]):
            wrong.append(f"sync {target_dtype}: {t.name} rank {ctx.rank} differs")
    return wrong


def _check(ctx: DeepSpeedRank) -> dict[str, Any]:
    engine = ctx.engine
    rank = ctx.rank
    spec = ctx.spec
    log: dict[str, float] = {}
    wrong: list[str] = []
    states = ("param",) + (OPT_STATES if spec.zero_stage > 0 else ())

    # 1. No collective: rank 0 alone, the others at a barrier.
    alone = timed(log, "maps rank 0 alone", lambda: trainer_storage(engine).maps) if rank == 0 else None
    tdist.barrier()
    got = timed(log, "maps + views, all states", lambda: trainer_storages(engine, ("param",)))
    param = got["param"]
    if alone is not None and alone != param.maps:
        wrong.append("maps built by rank 0 alone differ from the maps built by every rank")

    # 2. Before any step: the checkpoint.
    dtype = getattr(torch, spec.torch_dtype_name)
    ckpt = checkpoint_tensors(ctx.model_path, dtype)
    names = {m.name for m in param.maps}
    if names != set(ckpt):
        wrong.append(f"map names differ from the checkpoint's: {sorted(names ^ set(ckpt))[:6]}")
    wrong += compare_views(param.maps, param.sources, ckpt, rank, "param before step")
    if spec.zero_stage > 0:  # the master weights start as the checkpoint, in fp32
        pre = trainer_storages(engine, ("fp32",))["fp32"]
        wrong += compare_views(
            pre.maps, pre.sources, {n: t.float() for n, t in ckpt.items()}, rank, "fp32 before step"
        )

    # 3. After a step: DeepSpeed's own gathers, through the same views (they are the engine's buffers).
    timed(log, "train step", lambda: train_step(engine, seed=1))
    # DeepSpeed's own fp32 gathers go through _hp_mapping, whose offsets are wrong with round-robin
    # gradients (notes/deepspeed-on-cpu.md); there the fp32 views are checked against the parameters only.
    refs = ("param",) if _round_robin(spec) else states
    full = {s: timed(log, f"reference {s}", lambda s=s: full_tensors(engine, s)) for s in refs}
    if _round_robin(spec):
        full["fp32"] = {n: t.float() for n, t in full["param"].items()}  # for the sync check only
    wrong += compare_views(param.maps, param.sources, full["param"], rank, "param after step")
    if not any(not same_bits(full["param"][n], ckpt[n]) for n in names):
        wrong.append("the training step changed no parameter (the check would be vacuous)")
    after = timed(log, "maps + views, optimizer states", lambda: trainer_storages(engine, states))
    if after["param"].maps != param.maps:
        wrong.append("parameter maps changed across a step")
    if spec.zero_stage > 0:
        # The step writes the parameters from the master weights: the fp32 views, rounded, are the parameters.
        rounded = {n: v.to(dtype) for n, v in after["fp32"].sources.items()}
        wrong += compare_views(after["fp32"].maps, rounded, full["param"], rank, "fp32 rounded after step")
    for s in OPT_STATES if spec.zero_stage > 0 and not _round_robin(spec) else ():
        wrong += compare_views(after[s].maps, after[s].sources, full[s], rank, s)

    # 4. Plan and execute into another layout.
    wrong += timed(
        log,
        "plan + execute param",
        lambda: _sync_into_fresh_targets(
            ctx, param.maps, param.sources, spec.torch_dtype_name, full["param"]
        ),
    )
    if spec.zero_stage > 0:
        wrong += timed(
            log,
            "plan + execute fp32 -> bf16",
            lambda: _sync_into_fresh_targets(
                ctx, after["fp32"].maps, after["fp32"].sources, "bfloat16", full["fp32"]
            ),
        )

    # 5. The dry runs: the map builders' (parameters, where it models the configuration) and this
    #    package's (every state), from the model config and the layout description alone.
    dry = _dry_run(ctx)
    if dry is not None:
        live = {m.name: m for m in param.maps}
        differ = sorted(m.name for m in dry if live.get(m.name) != m)
        if differ or len(dry) != len(live):
            wrong.append(f"trainer_maps dry run differs from the live maps: {differ[:6]}")
    facts = dry_run_facts(
        _model(ctx),
        spec.zero_stage,
        ctx.world_size // spec.autotp_size,
        spec.autotp_size,
        spec.autoep_size,
        spec.torch_dtype_name,
        round_robin=_round_robin(spec),
    )
    for s in states:
        if [sm.map for sm in state_maps(facts, s)] != after[s].maps:
            wrong.append(f"dry_run_facts maps of {s} differ from the live maps")
    return {"wrong": wrong, "log": log, "startup": ctx.startup_s, "dry_run": dry is not None}


def _model(ctx: DeepSpeedRank) -> Any:
    import json

    return model_tensors(json.loads((ctx.model_path / "config.json").read_text()))


def _round_robin(spec: DeepSpeedSpec) -> bool:
    return bool(spec.extra_config.get("zero_optimization", {}).get("round_robin_gradients"))


def _dry_run(ctx: DeepSpeedRank) -> list[TensorMap] | None:
    import json

    spec = ctx.spec
    config = json.loads((ctx.model_path / "config.json").read_text())
    if spec.autotp_size > 1 and config.get("tie_word_embeddings"):
        return None  # the dry-run builder keeps a tied embedding whole; AutoTP splits it (see the report)
    tp = spec.autotp_size
    return trainer_maps(
        model_tensors(config),
        spec.zero_stage,
        ctx.world_size // tp,
        tp,
        spec.autoep_size,
        spec.torch_dtype_name,
    )


def _z3(spec: DeepSpeedSpec) -> DeepSpeedSpec:
    """Keep small parameters partitioned (a gathered one is refused, see test_trainer_refusals.py)."""
    return dataclasses.replace(
        spec, extra_config={"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    )


BF16_OPTIMIZER = {"data_types": {"grad_accum_dtype": "fp32"}}
ROUND_ROBIN = {"zero_optimization": {"round_robin_gradients": True}}

# One launch of ranks per group; AutoTP engines last in their launch (AutoTP's groups are process-wide).
GROUPS = [
    pytest.param(
        2,
        [
            DeepSpeedSpec("dense", 0, dtype="bf16"),
            DeepSpeedSpec("dense", 2, dtype="fp32"),
            DeepSpeedSpec("dense", 1, dtype="bf16", extra_config=BF16_OPTIMIZER),
            DeepSpeedSpec("dense", 0, autotp_size=2, dtype="fp32"),
            DeepSpeedSpec("dense-tied", 2, autotp_size=2, dtype="bf16"),
        ],
        id="w2-zero0-zero2fp32-bf16optimizer-tp2zero0fp32-tp2zero2tied",
    ),
    pytest.param(
        4,
        [
            DeepSpeedSpec("dense", 1, dtype="bf16"),
            DeepSpeedSpec("dense", 2, dtype="bf16", extra_config=ROUND_ROBIN),
            _z3(DeepSpeedSpec("dense-tied", 3, dtype="bf16", zero_init=True)),
            DeepSpeedSpec("dense", 1, autotp_size=2, dtype="bf16"),
            _z3(DeepSpeedSpec("dense", 3, autotp_size=2, dtype="bf16")),
        ],
        id="w4-zero1-zero2roundrobin-zero3zeroinittied-tp2zero1-tp2zero3",
    ),
    pytest.param(
        2,
        [
            DeepSpeedSpec("moe", 0, autoep_size=2, dtype="bf16"),
            DeepSpeedSpec("moe", 2, autoep_size=2, dtype="fp32"),
        ],
        id="w2-ep2zero0-ep2zero2fp32",
    ),
    pytest.param(
        4,
        [DeepSpeedSpec("moe", 1, autoep_size=2, dtype="bf16"), _z3(DeepSpeedSpec("moe", 3, autoep_size=2))],
        id="w4-ep2zero1-ep2zero3",
    ),
]


@pytest.mark.parametrize(("world", "specs"), GROUPS)
def test_storage_views_are_each_ranks_pieces_of_the_full_tensors_before_and_after_a_step(
    tiny_model: Any, world: int, specs: list[DeepSpeedSpec]
) -> None:
    started = time.perf_counter()
    results = run_engines(specs, [tiny_model(s.kind) for s in specs], _check, world, timeout=900)
    wall = time.perf_counter() - started
    wrong = [
        f"{_label(specs[i])}: {w}" for per_rank in results for i, r in enumerate(per_rank) for w in r["wrong"]
    ]
    assert not wrong, "\n".join(wrong[:20])
    print(f"\n{world} ranks, {len(specs)} engines: {wall:.1f} s wall")
    for spec, r in zip(specs, results[0], strict=True):
        print(
            f"  {_label(spec)}: engine built in {r['startup']:.1f} s, dry-run parity {r['dry_run']}, {r['log']}"
        )


def _label(spec: DeepSpeedSpec) -> str:
    parts = [spec.kind, f"zero{spec.zero_stage}", spec.dtype]
    if spec.autotp_size > 1:
        parts.append(f"tp{spec.autotp_size}")
    if spec.autoep_size > 1:
        parts.append(f"ep{spec.autoep_size}")
    if spec.zero_init:
        parts.append("zero.Init")
    if spec.extra_config:
        parts.append(str(spec.extra_config))
    return " ".join(parts)
