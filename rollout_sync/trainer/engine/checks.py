"""The refusals read from a live DeepSpeed 0.19.8 engine, before any storage is described.

- ``read_traits``: the engine-wide ``EngineTraits`` (offload, ZeRO++, MiCS, expert tensor parallelism,
  AutoEP with AutoTP, pipeline, sequence parallelism, the optimizer wrapper) that
  ``rollout_sync.trainer.engine.refusals.refuse_engine`` judges;
- ``check_expert_layers``: an AutoEP layer whose experts mix ZeRO-3 and non-ZeRO-3 parameters;
- ``check_zero3_param``: a ZeRO-3 parameter whose storage is not a plain even partition of its group
  (gathered, hpZ secondary, quantized, NVMe-offloaded, another group, another size).

Everything is read locally (no collective). Each refusal is an ``UnsupportedLayoutError`` or a
``LayoutError`` that names the parameter and the rank.
"""

from __future__ import annotations

from typing import Any

from ...errors import LayoutError, UnsupportedLayoutError
from ..facts import ZeroGroup
from .parts import autoep_layers, group_ranks, is_zero3_param
from .refusals import EngineTraits

__all__ = ["check_expert_layers", "check_zero3_param", "read_traits"]


def _device_of(config: Any) -> str:
    if config is None:
        return "none"
    device = getattr(config, "device", "none")
    return str(getattr(device, "value", device))


def read_traits(engine: Any) -> EngineTraits:
    """The engine-wide facts that decide whether its storage can be described."""
    zc = engine._config.zero_config
    stage = int(engine.zero_optimization_stage())
    opt = engine.optimizer
    offload_optimizer = _device_of(zc.offload_optimizer)
    offload_param = _device_of(zc.offload_param)
    if getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False):
        offload_optimizer = offload_optimizer if offload_optimizer != "none" else "cpu"
    if getattr(opt, "offload_param", False):
        offload_param = offload_param if offload_param != "none" else "cpu"
    ep_config = getattr(engine._config, "expert_parallel_config", None)
    has_autoep = autoep_layers(engine.module) != {}
    sp = 1
    try:
        from deepspeed.utils import groups

        sp = int(groups._get_sequence_parallel_world_size())
    except (ImportError, AssertionError, AttributeError):
        sp = 1
    return EngineTraits(
        stage=stage,
        optimizer=type(opt).__name__ if opt is not None else "None",
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        quantized_weights=bool(zc.zero_quantized_weights or zc.zero_quantized_nontrainable_weights),
        hpz_partition_size=int(zc.zero_hpz_partition_size or 1),
        mics="MiCS" in type(opt).__name__,
        expert_tensor_parallel=int(getattr(ep_config, "expert_tensor_parallel_size", 1) or 1)
        if has_autoep
        else 1,
        autoep_with_autotp=has_autoep and int(engine.autotp_size() or 1) > 1,
        pipeline=type(engine).__name__ == "PipelineEngine",
        sequence_parallel=sp,
    )


def check_expert_layers(layers: dict[str, Any], rank: int) -> None:
    """Refuse an AutoEP layer (of ``layers``, by name) whose expert parameters are partly ZeRO-3."""
    for layer_name, layer in layers.items():
        params = list(layer.experts.named_parameters())
        kinds = {is_zero3_param(p) for _, p in params}
        if len(kinds) > 1:
            raise UnsupportedLayoutError(
                "an AutoEP layer mixes ZeRO-3 and non-ZeRO-3 expert parameters",
                tensor=layer_name,
                rank=rank,
                found={n: is_zero3_param(p) for n, p in params},
            )


def check_zero3_param(name: str, p: Any, group: ZeroGroup, rank: int, allow_gathered: bool = False) -> None:
    """Refuse a parameter of a ZeRO-3 engine whose ``ds_tensor`` is not the even partition of ``group``
    that the maps describe (``allow_gathered``: see ``rollout_sync.trainer.engine.read.read_engine``)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if not is_zero3_param(p):
        raise UnsupportedLayoutError("a parameter that ZeRO-3 does not partition", tensor=name, rank=rank)
    if not allow_gathered and (p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0):
        raise UnsupportedLayoutError(
            "a gathered ZeRO-3 parameter is a derived copy; maps describe its partition only (release it "
            "first, e.g. leave GatheredParameters or call engine.empty_partition_cache())",
            tensor=name,
            rank=rank,
            expected="ds_status NOT_AVAILABLE",
            found=f"{p.ds_status.name}, param.data {tuple(p.shape)}",
        )
    if getattr(p, "ds_secondary_tensor", None) is not None:
        raise UnsupportedLayoutError("a ZeRO++ hpZ secondary partition", tensor=name, rank=rank)
    if hasattr(p.ds_tensor, "ds_quant_scale"):
        raise UnsupportedLayoutError("a quantized ZeRO-3 partition", tensor=name, rank=rank)
    final = getattr(p.ds_tensor, "final_location", None)
    if final is not None and "nvme" in str(final).lower():
        raise UnsupportedLayoutError(
            "an NVMe-offloaded ZeRO-3 partition", tensor=name, rank=rank, found=final
        )
    got = group_ranks(p.ds_process_group)
    if got != group.ranks:
        raise LayoutError(
            "the parameter's ZeRO-3 storage group does not match its group table",
            tensor=name,
            rank=rank,
            expected=group.ranks,
            found=got,
        )
    n = int(p.ds_numel)
    expected = -(-n // len(group.ranks))
    if p.ds_tensor.numel() != expected or int(getattr(p.ds_tensor, "ds_numel", expected)) != expected:
        raise LayoutError(
            "ds_tensor's size differs from ZeRO-3's even partitioning",
            tensor=name,
            rank=rank,
            expected=f"ceil({n} / {len(group.ranks)}) = {expected}",
            found=p.ds_tensor.numel(),
        )
