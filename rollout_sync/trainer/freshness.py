"""Does DeepSpeed still hold the buffers this rank's storage views were cut from?

A view (``rollout_sync.trainer.views``) aliases a DeepSpeed buffer: a parameter's data, a ZeRO-3
``ds_tensor``, a flat fp32 partition, an Adam state. DeepSpeed may replace such a buffer with another tensor
(DeepSpeed 0.19.8's ``load_checkpoint`` replaces the optimizer's Adam states through
``torch.optim.Optimizer.load_state_dict`` at ZeRO-1/2/3; anything that reallocates a flat partition or
rebinds ``param.data`` / ``ds_tensor``). The view then keeps the old memory alive and a sync would send it:
stale values, silently.

``BufferWatch`` remembers, per distinct buffer, how to fetch the tensor the engine holds in that place now
and the buffer's identity when the views were cut (its storage object, first element's offset, element
count, dtype). ``stale()`` compares them: a few attribute lookups per buffer, no collective. Since each view
keeps its buffer's storage alive, a new buffer can never reuse the old storage object: the same storage means
the same memory. The storage's *address* is not part of the identity: a same-host transport moves a storage
into shared memory in place (``rollout_sync.transport.core.mapped``), which changes its address but not the
storage every view and DeepSpeed itself hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BufferStamp", "BufferWatch", "StaleBuffer", "stamp"]


@dataclass(frozen=True, slots=True)
class BufferStamp:
    storage: int  # the storage object (``UntypedStorage._cdata``), stable when moved into shared memory
    offset: int  # the first element's offset in the storage, in elements
    numel: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return (
            f"{self.numel} x {str(self.dtype).removeprefix('torch.')} "
            f"at offset {self.offset} of storage {self.storage:#x}"
        )


def stamp(t: Any) -> BufferStamp | None:
    """The identity of tensor ``t`` (None for anything that is not a tensor: a state that is gone)."""
    if not isinstance(t, torch.Tensor):
        return None
    return BufferStamp(t.untyped_storage()._cdata, int(t.storage_offset()), t.numel(), t.dtype)


@dataclass(frozen=True)
class Anchor:
    """One buffer some views were cut from: where the engine keeps it, what it was, which views use it."""

    what: str  # e.g. "param model.layers.0.mlp.up_proj.weight" or "exp_avg of model.embed_tokens.weight"
    source: Callable[[], Any]
    was: BufferStamp
    names: tuple[str, ...]  # logical tensors whose views alias this buffer


@dataclass(frozen=True)
class StaleBuffer:
    what: str
    names: tuple[str, ...]
    was: BufferStamp
    now: BufferStamp | None

    def describe(self) -> str:
        now = "no tensor" if self.now is None else str(self.now)
        return f"{self.what}: was {self.was}, the engine now holds {now}"


class BufferWatch:
    def __init__(self, anchors: Iterable[Anchor]) -> None:
        self.anchors = tuple(anchors)

    def __len__(self) -> int:
        return len(self.anchors)

    def stale(self) -> list[StaleBuffer]:
        """Every buffer the engine no longer holds as it was when the views were cut."""
        out = []
        for a in self.anchors:
            try:
                now = stamp(a.source())
            except (AttributeError, IndexError, KeyError, TypeError):
                now = None  # the place itself is gone (a list shrank, an optimizer was replaced)
            if now != a.was:
                out.append(StaleBuffer(a.what, a.names, a.was, now))
        return out


def anchor_builder() -> tuple[
    Callable[[str, str, torch.Tensor, Callable[[], Any]], None], Callable[[], BufferWatch]
]:
    """``add(name, what, buffer, source)`` records that the view of logical tensor ``name`` was cut from
    ``buffer`` (fetched again by ``source``); views sharing one buffer share one anchor. ``done()`` returns
    the watch."""
    by_buffer: dict[int, tuple[str, Callable[[], Any], BufferStamp, list[str], torch.Tensor]] = {}

    def add(name: str, what: str, buffer: torch.Tensor, source: Callable[[], Any]) -> None:
        entry = by_buffer.get(id(buffer))
        if entry is None:
            was = stamp(buffer)
            if was is None:
                raise TypeError(f"{what}: not a tensor")
            # Keep ``buffer`` in the entry: ids stay unique while the build runs.
            by_buffer[id(buffer)] = (what, source, was, [name], buffer)
        else:
            entry[3].append(name)

    def done() -> BufferWatch:
        return BufferWatch(
            Anchor(what, source, was, tuple(names)) for what, source, was, names, _ in by_buffer.values()
        )

    return add, done
