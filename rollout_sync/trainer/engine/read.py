"""Read layout facts, and this rank's own buffers, from a live DeepSpeed 0.19.8 engine: ``read_engine``.

Everything is read locally: no collective runs, so any rank may call this alone. Facts about other ranks
(their groups, their shards, where their shards sit in their flat buffers) follow from DeepSpeed's rules,
each in its own module:

- ``checks``: the engine-wide traits ``refusals.refuse_engine`` judges, and the per-parameter
  refusals (mixed ZeRO-3 experts, a ZeRO-3 partition that is not the even partition of its group);
- ``placements``: AutoTP and AutoEP placements, the ZeRO group of each shard, the logical tensors;
- ``zero_positions``: this rank's buffers (``LocalParam``) and the flat positions of ZeRO-1/2/3.

Every rule is checked against what this rank really has (its own groups, shard shapes, flat offsets,
partition sizes), and a disagreement is refused rather than guessed around.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import LayoutError, ShapeMismatchError, UnsupportedLayoutError
from ...layout.dtypes import dtype_name
from ..facts import ParamFacts, TrainerFacts
from .checks import check_expert_layers, check_zero3_param, read_traits
from .parts import full_param_shape, is_zero3_param
from .placements import ParamPlacement, PlacementReader
from .refusals import refuse_engine
from .zero_positions import LocalParam, zero3_positions, zero12_positions

__all__ = ["ReadEngine", "read_engine"]


@dataclass
class ReadEngine:
    """Facts (about every rank) and this rank's own buffers."""

    facts: TrainerFacts
    local: dict[str, LocalParam]
    basic_optimizer: Any
    rank: int
    #: The engine's basic optimizer now (whose ``state`` holds the Adam states), for freshness checks.
    optimizer_source: Callable[[], Any] | None = None


def _attribute(obj: Any, attribute: str) -> Callable[[], Any]:
    def source() -> Any:
        return getattr(obj, attribute, None)

    return source


def _itself(obj: Any) -> Callable[[], Any]:
    return lambda: obj


def read_engine(engine: Any, *, allow_gathered: bool = False) -> ReadEngine:
    """Layout facts of ``engine`` and this rank's own buffers; raises the refusals of
    ``rollout_sync.trainer.engine.refusals``, ``checks``, ``placements`` and ``zero_positions`` before
    anything moves.

    ``allow_gathered`` accepts ZeRO-3 parameters that are gathered (persistent parameters stay gathered
    after the first forward): for re-deriving views during training, where the views are of the partitions
    (``ds_tensor``) DeepSpeed steps and re-gathers from. A first description refuses them."""
    refuse_engine(read_traits(engine))
    reader = PlacementReader(engine)
    check_expert_layers(reader.autoep, reader.rank)
    stage = int(engine.zero_optimization_stage())
    rank = reader.rank

    named = list(engine.module.named_parameters())
    placements: dict[str, ParamPlacement] = {}
    local: dict[str, LocalParam] = {}
    param_dtypes = set()
    for name, p in named:
        layout, zero, own, parts = reader.placement(name, p)
        placements[name] = (layout, zero, own, parts)
        shard = layout.shards.get(own)
        local_shape = full_param_shape(p)
        if shard is None or tuple(shard.shape) != local_shape:
            raise ShapeMismatchError(
                "this rank's parameter differs from its placement shard",
                tensor=name,
                rank=rank,
                expected=None if shard is None else shard.shape,
                found=local_shape,
            )
        param_dtypes.add(p.dtype)
        if stage == 3:
            check_zero3_param(name, p, zero[own], rank, allow_gathered)
            k = zero[own].ranks.index(rank)
            local[name] = LocalParam(
                name, own, p.ds_tensor, -k * p.ds_tensor.numel(), lp_source=_attribute(p, "ds_tensor")
            )
        else:
            if is_zero3_param(p):
                raise UnsupportedLayoutError(
                    "a ZeRO-3 parameter in a ZeRO-0/1/2 engine", tensor=name, rank=rank
                )
            if rank not in zero[own].ranks:
                raise LayoutError(
                    "this rank is not in its own ZeRO group", tensor=name, rank=rank, expected=zero[own].ranks
                )
            data = p.data
            if not data.is_contiguous():
                raise LayoutError("a parameter that is not contiguous", tensor=name, rank=rank)
            local[name] = LocalParam(name, own, data.reshape(-1), 0, lp_source=_itself(p))
    if len(param_dtypes) > 1:
        raise UnsupportedLayoutError(
            "parameters of several dtypes",
            expected="one dtype",
            found=sorted(dtype_name(d) for d in param_dtypes),
        )
    param_dtype = dtype_name(next(iter(param_dtypes))) if param_dtypes else "bfloat16"

    master_dtype: str | None = None
    by_id = {id(p): name for name, p in named}
    if stage in (1, 2):
        master_dtype = zero12_positions(engine, rank, by_id, placements, local)
    elif stage == 3:
        master_dtype = zero3_positions(engine, rank, by_id, local)

    params = []
    for name, _ in named:
        layout, zero, _, parts = placements[name]
        trainable = stage == 0 or local[name].hp is not None
        params.append(ParamFacts(name, tuple(layout.shape), layout, zero, parts, trainable))
    facts = TrainerFacts(stage, param_dtype, master_dtype, tuple(params))
    basic = getattr(engine.optimizer, "optimizer", None) if stage > 0 else None

    def basic_now() -> Any:
        return getattr(engine.optimizer, "optimizer", None) if stage > 0 else None

    return ReadEngine(facts, local, basic, rank, basic_now)
