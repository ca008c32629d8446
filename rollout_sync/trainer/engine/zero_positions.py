"""Where this rank's own shards sit in DeepSpeed 0.19.8's ZeRO buffers: ``LocalParam`` (a parameter's
low-precision shard and fp32 master partition, with their shifts), the flat positions of ZeRO-1/2
(``zero12_positions``) and ZeRO-3 (``zero3_positions``), and ``flat_view`` (a view of a buffer's run).

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``, ``BF16_Optimizer``): each optimizer group's parameters are views of
  one flat low-precision buffer laid out by ``rollout_sync.geometry.deepspeed.zero12_flat_layout``;
  group rank ``i`` keeps partition ``i`` of it in fp32. The rule gives every shard's flat offset on every
  rank; this rank's own parameter views and buffer sizes are checked against it.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): each sub-group's ``ds_tensor`` partitions lie back to back in
  one low-precision and one fp32 flat partition buffer, in the sub-group's order.

Everything is read locally (no collective); a disagreement with the rule is a ``LayoutError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from ...errors import LayoutError, UnsupportedLayoutError
from ...geometry.deepspeed import param_alignment_for, zero12_flat_layout
from ...layout.dtypes import dtype_name
from ..facts import ZeroGroup
from .parts import group_ranks
from .placements import ParamPlacement

__all__ = ["LocalParam", "flat_view", "zero3_positions", "zero12_positions"]


@dataclass
class LocalParam:
    """This rank's own buffers of one parameter.

    ``lp`` holds the low-precision parameter's own shard: element ``x`` of the shard's flattening is
    ``lp[x + lp_shift]`` (for the elements this rank stores). ``hp`` is the fp32 master partition (also the
    key of the optimizer's per-tensor state) with ``hp_shift`` likewise; ``None`` for a parameter the
    optimizer does not own (frozen) or an engine without master weights (ZeRO-0).

    ``lp_source`` / ``hp_source`` fetch the tensor the engine holds *now* in the place ``lp`` / ``hp`` were
    read from (the parameter, its ``ds_tensor``, the optimizer's list entry): ``rollout_sync.trainer.freshness``
    compares them with the buffers the views were cut from, to notice a buffer DeepSpeed replaced.
    """

    name: str
    placement_rank: int
    lp: torch.Tensor
    lp_shift: int
    hp: torch.Tensor | None = None
    hp_shift: int = 0
    lp_source: Callable[[], Any] | None = None
    hp_source: Callable[[], Any] | None = None


def _offset_in(view: torch.Tensor, base: torch.Tensor, *, name: str, rank: int) -> int:
    """Element offset of ``view``'s first element inside ``base`` (the same memory), or a refusal."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        raise LayoutError("a parameter is not a view of its flat buffer", tensor=name, rank=rank)
    diff = view.data_ptr() - base.data_ptr()
    size = base.element_size()
    if diff % size or not view.is_contiguous():
        raise LayoutError(
            "a parameter view is not element-aligned and contiguous in its buffer", tensor=name, rank=rank
        )
    return diff // size


@dataclass
class _FlatGroup:
    params: list[torch.nn.Parameter]  # flat order
    flat: torch.Tensor
    hp: torch.Tensor
    ranks: tuple[int, ...]
    param_alignment: int
    hp_source: Callable[[], Any]


def _entry(engine: Any, attribute: str, index: int) -> Callable[[], Any]:
    """Fetches ``engine.optimizer.<attribute>[index]`` as it is when called."""

    def source() -> Any:
        return getattr(engine.optimizer, attribute)[index]

    return source


def _flat_groups(engine: Any) -> list[_FlatGroup]:
    """The ZeRO-1/2 optimizer's groups: parameters in flat order, flat buffer, fp32 partition, group."""
    opt = engine.optimizer
    out = []
    if type(opt).__name__ == "BF16_Optimizer":
        for g, params in enumerate(opt.bf16_groups):
            out.append(
                _FlatGroup(
                    list(params),
                    opt.bf16_groups_flat[g],
                    opt.fp32_groups_flat_partition[g],
                    group_ranks(opt.real_dp_process_group[g]),
                    1,
                    _entry(engine, "fp32_groups_flat_partition", g),
                )
            )
        return out
    for g, params in enumerate(opt.round_robin_bit16_groups):
        flat = opt.bit16_groups_flat[g]
        out.append(
            _FlatGroup(
                list(params),
                flat,
                opt.single_partition_of_fp32_groups[g],
                group_ranks(opt.real_dp_process_group[g]),
                param_alignment_for(flat.element_size(), bool(opt.parameter_alignment)),
                _entry(engine, "single_partition_of_fp32_groups", g),
            )
        )
    return out


def zero12_positions(
    engine: Any,
    rank: int,
    by_id: dict[int, str],
    placements: dict[str, ParamPlacement],
    local: dict[str, LocalParam],
) -> str | None:
    """Under ZeRO-1/2: fill in every shard's flat position on every rank (``placements``' ZeRO groups) and
    this rank's fp32 master partition (``local``); the master weights' dtype name, ``None`` without any.

    ``by_id``: parameter name by ``id`` of the parameter; ``placements`` and ``local`` by parameter name."""
    dtypes = set()
    for fg in _flat_groups(engine):
        names = []
        for p in fg.params:
            name = by_id.get(id(p))
            if name is None:
                raise LayoutError("an optimizer parameter the module does not name", rank=rank)
            names.append(name)
        if not names:
            continue
        own = {placements[n][2] for n in names}
        keys = {tuple(sorted(placements[n][0].shards)) for n in names}
        if len(own) != 1 or len(keys) != 1:
            raise LayoutError(
                "one flat buffer holds parameters of different placements",
                tensor=names[0],
                rank=rank,
                found=sorted(own),
            )
        own_k = own.pop()
        for n in names:
            if placements[n][1][own_k].ranks != fg.ranks:
                raise LayoutError(
                    "the parameter's ZeRO-1/2 storage group does not match its group table",
                    tensor=n,
                    rank=rank,
                    expected=placements[n][1][own_k].ranks,
                    found=fg.ranks,
                )
        dp = len(fg.ranks)
        for k in keys.pop():
            numels = [prod(placements[n][0].shards[k].shape) for n in names]
            offsets, total = zero12_flat_layout(numels, dp, param_alignment=fg.param_alignment)
            if k == own_k:
                actual = [
                    _offset_in(p.data, fg.flat, name=n, rank=rank)
                    for n, p in zip(names, fg.params, strict=True)
                ]
                if actual != list(offsets) or fg.flat.numel() != total or fg.hp.numel() != total // dp:
                    raise LayoutError(
                        "DeepSpeed's flat buffer differs from the ZeRO-1/2 layout rule",
                        tensor=names[0],
                        rank=rank,
                        expected=(offsets, total, total // dp),
                        found=(tuple(actual), fg.flat.numel(), fg.hp.numel()),
                    )
            for n, o in zip(names, offsets, strict=True):
                zero = placements[n][1]
                zero[k] = ZeroGroup(zero[k].ranks, o, total)
        i = fg.ranks.index(rank)
        part = total // dp
        for n in names:
            o = placements[n][1][own_k].flat_offset or 0
            local[n].hp = fg.hp
            local[n].hp_shift = o - i * part
            local[n].hp_source = fg.hp_source
        dtypes.add(fg.hp.dtype)
    if len(dtypes) > 1:
        raise UnsupportedLayoutError(
            "master weights of several dtypes", found=sorted(dtype_name(d) for d in dtypes)
        )
    return dtype_name(dtypes.pop()) if dtypes else None


def zero3_positions(
    engine: Any, rank: int, by_id: dict[int, str], local: dict[str, LocalParam]
) -> str | None:
    """Under ZeRO-3: this rank's fp32 master partition of every parameter (``local``, whose low-precision
    partitions are already read), checked against the flat partition buffers; the master weights' dtype
    name, ``None`` without any. ``by_id``: parameter name by ``id`` of the parameter."""
    opt = engine.optimizer
    dtypes = set()
    for sg, params in enumerate(opt.fp16_groups):
        lp_flat = opt.fp16_partitioned_groups_flat[sg]
        hp_flat = opt.fp32_partitioned_groups_flat[sg]
        offset = 0
        for p in params:
            name = by_id.get(id(p))
            if name is None:
                raise LayoutError("an optimizer parameter the module does not name", rank=rank)
            if lp_flat is None or _offset_in(p.ds_tensor, lp_flat, name=name, rank=rank) != offset:
                raise LayoutError(
                    "ds_tensor is not at its place in the ZeRO-3 flat partition buffer",
                    tensor=name,
                    rank=rank,
                    expected=offset,
                )
            lp = local[name]
            lp.hp = hp_flat
            lp.hp_shift = offset + lp.lp_shift
            lp.hp_source = _entry(engine, "fp32_partitioned_groups_flat", sg)
            offset += p.ds_tensor.numel()
        if hp_flat.numel() != offset:
            raise LayoutError(
                "ZeRO-3 fp32 partition buffer differs from its parameters' partitions",
                rank=rank,
                expected=offset,
                found=hp_flat.numel(),
            )
        dtypes.add(hp_flat.dtype)
    if len(dtypes) > 1:
        raise UnsupportedLayoutError(
            "master weights of several dtypes", found=sorted(dtype_name(d) for d in dtypes)
        )
    return dtype_name(dtypes.pop()) if dtypes else None


def flat_view(buffer: torch.Tensor, start: int, stop: int, shift: int, shape: Sequence[int]) -> torch.Tensor:
    """``buffer[start + shift : stop + shift]`` viewed with ``shape`` (a view, never a copy)."""
    if stop == start:
        return buffer.reshape(-1)[:0].view(tuple(shape))
    lo = start + shift
    hi = stop + shift
    if lo < 0 or hi > buffer.numel():
        raise LayoutError(
            "a storage view runs outside its buffer", expected=f"[0, {buffer.numel()})", found=f"[{lo}, {hi})"
        )
    return buffer.reshape(-1)[lo:hi].view(tuple(shape))
