"""Layout facts of a DeepSpeed training engine, as plain data (no torch, no DeepSpeed).

A live adapter (``rollout_sync.trainer.engine.read``) reads these from an engine; a dry run can write them
down from a model config and a layout description. Map builders (``rollout_sync.trainer.storage_maps``)
are pure functions of them.

Three levels describe where an element of a logical tensor lives:

1. a **parameter** of the trainer (``ParamFacts``): one DeepSpeed parameter, named as the engine's module
   names it, in its *full* shape (before AutoTP splits it, with every expert of an AutoEP layer). Each
   logical tensor is a block of one parameter (``LogicalPart``): usually the whole parameter, one expert of
   a packed ``[experts, ...]`` parameter, or the gate/up half of a fused one;
2. its **placement** (``ParamFacts.placement``, a ``Layout`` in placement ranks): which shard each TP rank
   (AutoTP) or EP rank (AutoEP) holds. A parameter with neither has one shard, placement rank 0;
3. the **ZeRO storage** of each shard over its ZeRO group (``ZeroGroup``): whole on every rank (ZeRO-0/1/2
   low-precision parameters), an even partition of the shard's flattening (ZeRO-3 ``ds_tensor``, and its
   fp32 master and Adam states), or a run of a flat group buffer that the group partitions evenly (ZeRO-1/2
   fp32 master and Adam states).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import LayoutError
from ..layout.shards import Layout

__all__ = ["STATES", "LogicalPart", "ParamFacts", "TrainerFacts", "ZeroGroup"]

STATES = ("param", "fp32", "exp_avg", "exp_avg_sq")
"""What a map can describe: the low-precision parameter the forward reads (``param``), the fp32 master
weights (``fp32``), and Adam's first and second moments (``exp_avg``, ``exp_avg_sq``)."""


@dataclass(frozen=True, slots=True)
class LogicalPart:
    """A logical tensor as the block ``origin, extent`` of its parameter's full shape.

    ``shape`` is the logical tensor's shape: ``extent`` without its leading axes of extent 1 when the
    logical tensor has fewer axes (expert ``e`` of a packed ``[E, I, H]`` parameter is the block ``(e, 0,
    0) + (1, I, H)`` with shape ``(I, H)``).
    """

    name: str
    shape: tuple[int, ...]
    origin: tuple[int, ...]
    extent: tuple[int, ...]

    def __post_init__(self) -> None:
        drop = len(self.extent) - len(self.shape)
        if (
            len(self.origin) != len(self.extent)
            or drop < 0
            or any(e != 1 for e in self.extent[:drop])
            or tuple(self.extent[drop:]) != tuple(self.shape)
        ):
            raise LayoutError(
                "a logical part's shape must be its block's extent without leading axes of extent 1",
                tensor=self.name,
                expected=f"extent ending in {self.shape}",
                found=f"origin {self.origin}, extent {self.extent}",
            )

    @property
    def dropped(self) -> int:
        """How many leading axes of the parameter the logical tensor drops."""
        return len(self.extent) - len(self.shape)


@dataclass(frozen=True, slots=True)
class ZeroGroup:
    """The ZeRO storage of one placement shard.

    ``ranks``: the global ranks of the ZeRO group (the DP group of a TP rank, the expert-data-parallel group
    of an EP rank), in group-rank order. ZeRO-1/2 only: the shard sits at ``flat_offset`` in a flat buffer
    of ``flat_numel`` elements (padding included) of which group rank ``i`` holds the fp32 master and Adam
    states of elements ``[i·P, (i+1)·P)``, ``P = flat_numel / len(ranks)``.
    """

    ranks: tuple[int, ...]
    flat_offset: int | None = None
    flat_numel: int | None = None

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise LayoutError(
                "a ZeRO group needs distinct ranks >= 0", expected="distinct ranks", found=self.ranks
            )
        if (self.flat_offset is None) != (self.flat_numel is None):
            raise LayoutError(
                "a flat buffer position needs both an offset and a size",
                expected="both or neither",
                found=(self.flat_offset, self.flat_numel),
            )
        if self.flat_numel is not None and (self.flat_numel % len(self.ranks) or (self.flat_offset or 0) < 0):
            raise LayoutError(
                "a ZeRO-1/2 flat buffer is partitioned evenly over its group",
                expected=f"a multiple of {len(self.ranks)} elements",
                found=(self.flat_offset, self.flat_numel),
            )


@dataclass(frozen=True, slots=True)
class ParamFacts:
    """One DeepSpeed parameter: its name in the engine's module, its full shape, where its placement puts
    each shard (``placement``, placement ranks = TP or EP ranks), the ZeRO storage of each shard (``zero``,
    keyed like ``placement.shards``), the logical tensors it holds (``parts``), and whether the optimizer
    owns it (``trainable``: a frozen parameter has no master weights or optimizer states)."""

    name: str
    shape: tuple[int, ...]
    placement: Layout
    zero: Mapping[int, ZeroGroup]
    parts: tuple[LogicalPart, ...]
    trainable: bool = True

    def __post_init__(self) -> None:
        if set(self.zero) != set(self.placement.shards):
            raise LayoutError(
                "every placement shard needs its ZeRO group",
                tensor=self.name,
                expected=sorted(self.placement.shards),
                found=sorted(self.zero),
            )
        if tuple(self.placement.shape) != tuple(self.shape):
            raise LayoutError(
                "placement of another shape than its parameter",
                tensor=self.name,
                expected=self.shape,
                found=self.placement.shape,
            )


@dataclass(frozen=True, slots=True)
class TrainerFacts:
    """Everything the map builders need about one engine.

    ``stage``: the ZeRO stage (0..3). ``param_dtype``: the dtype of the parameters the forward reads;
    ``master_dtype``: the dtype of the master weights and optimizer states (``None`` where the engine
    keeps none that a map can describe, e.g. ZeRO-0).
    """

    stage: int
    param_dtype: str
    master_dtype: str | None
    params: tuple[ParamFacts, ...]

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise LayoutError("unknown ZeRO stage", expected="0, 1, 2 or 3", found=self.stage)
