"""Storage views: this rank's storage of each logical tensor, as a view of DeepSpeed's own buffers (the
tensors the engine trains, never copies).

- ``param``: the low-precision parameter (``param.data`` under ZeRO-0/1/2, a view into ZeRO-1/2's
  ``bit16_groups_flat``; ``param.ds_tensor`` without padding under ZeRO-3);
- ``fp32``: the fp32 master partition (ZeRO-1/2 ``single_partition_of_fp32_groups`` or ``BF16_Optimizer``'s
  ``fp32_groups_flat_partition``; ZeRO-3 ``fp32_partitioned_groups_flat``);
- ``exp_avg`` / ``exp_avg_sq``: the optimizer's state for that master partition (the same geometry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import LayoutError, ShapeMismatchError, UnsupportedLayoutError
from .engine.read import ReadEngine
from .engine.zero_positions import LocalParam, flat_view
from .freshness import BufferWatch, anchor_builder
from .storage_maps import StorageMap

__all__ = ["state_buffer", "state_source", "storage_views", "watched_views"]


def state_buffer(read: ReadEngine, lp: LocalParam, state: str) -> tuple[torch.Tensor, int]:
    """The buffer holding this rank's elements of ``lp``'s shard for ``state``, and the shift: element
    ``x`` of the shard's flattening is ``buffer[x + shift]``."""
    if state == "param":
        return lp.lp, lp.lp_shift
    if lp.hp is None:
        raise UnsupportedLayoutError(
            "no master weights for this parameter", tensor=lp.name, rank=read.rank, found=state
        )
    if state == "fp32":
        return lp.hp, lp.hp_shift
    opt = read.basic_optimizer
    entry = None if opt is None else opt.state.get(lp.hp)
    tensor = None if entry is None else entry.get(state)
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedLayoutError(
            "the optimizer holds no such state for this parameter (has it taken a step? is it Adam?)",
            tensor=lp.name,
            rank=read.rank,
            expected=state,
            found=None if entry is None else sorted(entry),
        )
    if tensor.shape != lp.hp.shape or not tensor.is_contiguous():
        raise ShapeMismatchError(
            "an optimizer state differs in shape from its master partition",
            tensor=lp.name,
            rank=read.rank,
            expected=tuple(lp.hp.shape),
            found=tuple(tensor.shape),
        )
    return tensor, lp.hp_shift


def state_source(read: ReadEngine, lp: LocalParam, state: str) -> Callable[[], Any]:
    """Fetches the buffer ``state_buffer`` returns, as the engine holds it when called."""
    if state == "param":
        if lp.lp_source is None:
            raise UnsupportedLayoutError(
                "no source for this parameter's buffer", tensor=lp.name, rank=read.rank
            )
        return lp.lp_source
    if lp.hp_source is None:
        raise UnsupportedLayoutError("no source for the master weights", tensor=lp.name, rank=read.rank)
    hp_source = lp.hp_source
    if state == "fp32":
        return hp_source
    optimizer = read.optimizer_source

    def source() -> Any:
        opt = optimizer() if optimizer is not None else None
        entry = None if opt is None else opt.state.get(hp_source())
        return None if entry is None else entry.get(state)

    return source


def _what(lp: LocalParam, state: str) -> str:
    return f"parameter {lp.name}" if state == "param" else f"{state} of parameter {lp.name}"


def watched_views(
    read: ReadEngine, maps: Iterable[StorageMap], state: str
) -> tuple[dict[str, torch.Tensor], BufferWatch]:
    """``storage_views`` and a watch over the buffers they were cut from (see ``freshness``)."""
    add, done = anchor_builder()
    views = storage_views(read, maps, state, on_view=add)
    return views, done()


def storage_views(
    read: ReadEngine,
    maps: Iterable[StorageMap],
    state: str,
    on_view: Callable[[str, str, torch.Tensor, Callable[[], Any]], None] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's storage view of every logical tensor of ``maps`` it stores, keyed by logical name.
    ``on_view(name, what, buffer, source)`` is told the buffer each view was cut from."""
    out: dict[str, torch.Tensor] = {}
    for sm in maps:
        run = sm.local.get(read.rank)
        if run is None:
            continue
        lp = read.local[run.param]
        if lp.placement_rank != run.shard:
            raise LayoutError(
                "a map places this rank's storage in another shard than the rank holds",
                tensor=sm.map.name,
                rank=read.rank,
                expected=lp.placement_rank,
                found=run.shard,
            )
        buffer, shift = state_buffer(read, lp, state)
        view = flat_view(buffer, run.start, run.stop, shift, run.shape)
        storage = sm.map.ranks[read.rank]
        if tuple(view.shape) != tuple(storage.shape):
            raise ShapeMismatchError(
                "a storage view differs from its map",
                tensor=sm.map.name,
                rank=read.rank,
                expected=storage.shape,
                found=tuple(view.shape),
            )
        out[sm.map.name] = view
        if on_view is not None:
            on_view(sm.map.name, _what(lp, state), buffer, state_source(read, lp, state))
    return out
