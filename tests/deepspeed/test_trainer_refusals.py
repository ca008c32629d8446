"""What the trainer maps refuse on live DeepSpeed engines, before anything moves: offloaded optimizer states
and parameters, a gathered ZeRO-3 parameter, a ``ds_tensor`` of the wrong size, a storage group that does
not match the expert-data-parallel table, mixed ZeRO-3 and non-ZeRO-3 experts, ZeRO++ hpZ secondary
partitions.

Not reachable with an engine here, so covered on the engine traits the adapter reads
(``tests/unit/test_trainer_maps.py``): NVMe offload (needs libaio), ZeRO++ weight quantization (no CPU
kernel), expert tensor parallelism (DeepSpeed refuses it for AutoEP under ZeRO-3, and AutoTP's tp_plan
refuses the tiny Qwen3-MoE), MiCS (removed from DeepSpeed 0.19.8, whose config parser rejects
``mics_shard_size``; a MiCS-style shard group is what the regrouped-experts case below builds)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trainer_helpers import run_engines

from rollout_sync.errors import LayoutError, UnsupportedLayoutError
from rollout_sync.trainer import trainer_storage, trainer_storages
from tests.harness.deepspeed_engines import DeepSpeedRank, DeepSpeedSpec, train_step

pytestmark = pytest.mark.deepspeed


def _refused(fn: Any, kind: type[Exception], match: str) -> str | None:
    """None when ``fn()`` raises ``kind`` whose message contains ``match``; else what happened."""
    try:
        fn()
    except kind as e:
        return None if match in str(e) else f"wrong message: {e}"
    except Exception as e:
        return f"wrong error {type(e).__name__}: {e}"
    return "not refused"


def _expert_refusals(ctx: DeepSpeedRank) -> dict[str, str | None]:
    """A ZeRO-3 AutoEP engine, doctored one fact at a time (and restored after each)."""
    import deepspeed
    import torch.distributed as tdist

    engine = ctx.engine
    train_step(engine, seed=3)
    out: dict[str, str | None] = {}
    trainer_storages(engine, ("param", "fp32", "exp_avg"))  # the undoctored engine is described
    layer = next(m for n, m in engine.module.named_modules() if type(m).__name__ == "AutoEPMoELayer")
    w1, w3 = layer.experts.w1, layer.experts.w3

    # A gathered ZeRO-3 parameter is a derived copy.
    with deepspeed.zero.GatheredParameters([w1]):
        out["gathered"] = _refused(lambda: trainer_storage(engine), UnsupportedLayoutError, "gathered ZeRO-3")

    # The storage group of an expert parameter must be its EDP group (a MiCS shard group fails the same way).
    group = w1.ds_process_group
    w1.ds_process_group = tdist.group.WORLD  # every rank, not the EDP group of this EP rank
    out["edp group"] = _refused(lambda: trainer_storage(engine), LayoutError, "storage group does not match")
    w1.ds_process_group = group

    # A ds_tensor whose size differs from the even partition.
    ds_tensor = w1.ds_tensor
    w1.ds_tensor = torch.zeros(ds_tensor.numel() + 1, dtype=ds_tensor.dtype)
    out["ds_tensor size"] = _refused(lambda: trainer_storage(engine), LayoutError, "even partitioning")
    w1.ds_tensor = ds_tensor

    # Mixed ZeRO-3 and non-ZeRO-3 expert parameters in one layer.
    plain = torch.nn.Parameter(torch.zeros(2, 2, dtype=w3.dtype))
    layer.experts.w3 = plain
    out["mixed experts"] = _refused(lambda: trainer_storage(engine), UnsupportedLayoutError, "mixes ZeRO-3")
    layer.experts.w3 = w3

    trainer_storage(engine)  # restored: described again
    return out


def _persistent(ctx: DeepSpeedRank) -> dict[str, str | None]:
    """Default persistence threshold: small parameters stay gathered after a step until the cache is
    emptied."""
    engine = ctx.engine
    train_step(engine, seed=4)
    out = {"persistent": _refused(lambda: trainer_storage(engine), UnsupportedLayoutError, "gathered ZeRO-3")}
    engine.empty_partition_cache()
    try:
        trainer_storage(engine)
        out["after empty_partition_cache"] = None
    except Exception as e:
        out["after empty_partition_cache"] = f"{type(e).__name__}: {e}"
    return out


def _offload(ctx: DeepSpeedRank) -> str | None:
    return _refused(lambda: trainer_storage(ctx.engine), UnsupportedLayoutError, "offloaded")


def _hpz(ctx: DeepSpeedRank) -> str | None:
    return _refused(lambda: trainer_storage(ctx.engine), UnsupportedLayoutError, "hpZ secondary partitions")


def _one(ctx: DeepSpeedRank) -> dict[str, str | None]:
    """The check of one engine of the launch, chosen by its spec."""
    zero = ctx.spec.extra_config.get("zero_optimization", {})
    if ctx.spec.autoep_size > 1:
        return _expert_refusals(ctx)
    if "offload_optimizer" in zero or "offload_param" in zero:
        return {"offload": _offload(ctx)}
    if zero.get("zero_hpz_partition_size", 1) > 1:
        return {"hpZ": _hpz(ctx)}
    return _persistent(ctx)


NO_PERSISTENCE = {"stage3_param_persistence_threshold": 0}
CPU_OFFLOAD = {"zero_force_ds_cpu_optimizer": False}


def _problems(results: list[list[dict[str, str | None]]]) -> dict[str, str]:
    return {
        f"rank {r}, engine {i}: {k}": v
        for r, per_rank in enumerate(results)
        for i, res in enumerate(per_rank)
        for k, v in res.items()
        if v is not None
    }


def test_offloaded_gathered_persistent_resized_regrouped_and_mixed_storage_is_refused(
    tiny_model: Any,
) -> None:
    specs = [
        DeepSpeedSpec(
            "dense",
            2,
            extra_config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, **CPU_OFFLOAD},
        ),
        DeepSpeedSpec(
            "dense",
            3,
            extra_config={
                "zero_optimization": {"offload_param": {"device": "cpu"}, **NO_PERSISTENCE},
                **CPU_OFFLOAD,
            },
        ),
        DeepSpeedSpec("dense", 3),  # default persistence threshold: small parameters stay gathered
        DeepSpeedSpec("moe", 3, autoep_size=2, extra_config={"zero_optimization": NO_PERSISTENCE}),
    ]
    results = run_engines(specs, [tiny_model(s.kind) for s in specs], _one, 2, timeout=900)
    assert not _problems(results), _problems(results)
    assert [set(r) for r in results[0]] == [
        {"offload"},
        {"offload"},
        {"persistent", "after empty_partition_cache"},
        {"gathered", "edp group", "ds_tensor size", "mixed experts"},
    ]


def test_zeropp_hierarchical_secondary_partitions_are_refused(tiny_model: Any) -> None:
    spec = DeepSpeedSpec(
        "dense", 3, extra_config={"zero_optimization": {"zero_hpz_partition_size": 2, **NO_PERSISTENCE}}
    )
    results = run_engines([spec], [tiny_model("dense")], _one, 4, timeout=600)
    assert not _problems(results), _problems(results)
    assert [set(r) for r in results[0]] == [{"hpZ"}]
