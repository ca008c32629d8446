"""Engine configurations whose storage the trainer maps do not describe, refused before anything moves.

``EngineTraits`` is what the live adapter reads from an engine (plain data); ``refuse_engine`` raises an
``UnsupportedLayoutError`` that names the feature and says what to change. Per-parameter refusals (a
gathered ZeRO-3 parameter, a ``ds_tensor`` of the wrong size, a storage group that does not match the
expert-data-parallel table, mixed ZeRO-3 and non-ZeRO-3 experts, a quantized or secondary partition) are
raised where the parameter is read (``rollout_sync.trainer.engine.checks``, ``placements``,
``zero_positions``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedLayoutError

__all__ = ["KNOWN_OPTIMIZERS", "EngineTraits", "refuse_engine"]

KNOWN_OPTIMIZERS = {
    1: ("DeepSpeedZeroOptimizer", "BF16_Optimizer"),
    2: ("DeepSpeedZeroOptimizer",),
    3: ("DeepSpeedZeroOptimizer_Stage3",),
}
"""The optimizer wrappers whose buffers the adapter reads, per ZeRO stage (ZeRO-0 reads parameters only)."""


@dataclass(frozen=True, slots=True)
class EngineTraits:
    """What decides whether an engine's storage can be described at all.

    ``offload_optimizer`` / ``offload_param``: ``"none"``, ``"cpu"`` or ``"nvme"`` (the configured device,
    or what the optimizer reports). ``quantized_weights``: ZeRO++ quantized weights (trainable or not).
    ``hpz_partition_size``: ZeRO++ hierarchical partitioning (secondary partitions). ``mics``: a MiCS
    optimizer (sharded over a group smaller than the data-parallel group). ``expert_tensor_parallel``: AutoEP's
    ``expert_tensor_parallel_size``. ``autoep_with_autotp``: AutoEP layers in an engine with AutoTP > 1.
    ``pipeline``: a pipeline engine. ``sequence_parallel``: the sequence-parallel size.
    """

    stage: int
    optimizer: str
    offload_optimizer: str = "none"
    offload_param: str = "none"
    quantized_weights: bool = False
    hpz_partition_size: int = 1
    mics: bool = False
    expert_tensor_parallel: int = 1
    autoep_with_autotp: bool = False
    pipeline: bool = False
    sequence_parallel: int = 1


def _refuse(what: str, found: object, fix: str) -> UnsupportedLayoutError:
    return UnsupportedLayoutError(
        f"{what} is not described by the trainer storage maps", expected=fix, found=found
    )


def refuse_engine(traits: EngineTraits) -> None:
    """Raise ``UnsupportedLayoutError`` for an engine whose storage the maps do not describe."""
    if traits.offload_optimizer != "none":
        raise _refuse(
            "an offloaded optimizer (ZeRO-Offload of the master weights and optimizer states)",
            f"offload_optimizer device {traits.offload_optimizer!r}",
            "keep optimizer states on the accelerator (zero_optimization.offload_optimizer.device: none)",
        )
    if traits.offload_param != "none":
        raise _refuse(
            "an offloaded ZeRO-3 parameter partition",
            f"offload_param device {traits.offload_param!r}",
            "keep parameter partitions on the accelerator (zero_optimization.offload_param.device: none)",
        )
    if traits.quantized_weights:
        raise _refuse(
            "quantized ZeRO-3 storage (ZeRO++ zero_quantized_weights / zero_quantized_nontrainable_weights)",
            True,
            "turn weight quantization off",
        )
    if traits.mics:
        raise _refuse("a MiCS shard group", traits.optimizer, "use plain ZeRO-3")
    if traits.hpz_partition_size > 1:
        raise _refuse(
            "ZeRO++ hierarchical partitioning (hpZ secondary partitions)",
            f"zero_hpz_partition_size {traits.hpz_partition_size}",
            "set zero_hpz_partition_size to 1",
        )
    if traits.expert_tensor_parallel > 1:
        raise _refuse(
            "expert tensor parallelism",
            f"expert_tensor_parallel_size {traits.expert_tensor_parallel}",
            "set expert_parallel.expert_tensor_parallel_size to 1",
        )
    if traits.autoep_with_autotp:
        raise _refuse("AutoEP combined with AutoTP", True, "use AutoEP with autotp_size 1")
    if traits.pipeline:
        raise _refuse("a pipeline-parallel engine", traits.optimizer, "use a non-pipeline engine")
    if traits.sequence_parallel > 1:
        raise _refuse(
            "sequence parallelism", f"sequence parallel size {traits.sequence_parallel}", "turn it off"
        )
    known = KNOWN_OPTIMIZERS.get(traits.stage)
    if known is not None and traits.optimizer not in known:
        raise _refuse(
            f"a ZeRO-{traits.stage} engine whose optimizer wrapper is {traits.optimizer}",
            traits.optimizer,
            f"use one of {known}",
        )
