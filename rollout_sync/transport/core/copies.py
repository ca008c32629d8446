"""Where a part of a message sits in a rank's storage. Pure (no torch).

- ``part_copies``: the strided copies (``torch.as_strided`` arguments) that move a part between its message
  buffer and its source or target storage: one flat copy where the segment is dense in that storage, else
  one per box of the part's flat run (at most ``2·ndim − 1``). ``program`` compiles them once per schedule.
- ``part_runs``: the contiguous runs of a part a receiver pulls straight from its same-host sender's memory
  (``pulls``, ``cross_memory``): one for a part dense on both sides, else one per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ...layout.runs import flat_run_boxes
from .pair_messages import Part, is_dense

__all__ = ["Copy", "part_copies", "part_runs"]


@dataclass(frozen=True, slots=True)
class Copy:
    """One strided copy between a storage and a message buffer: ``torch.as_strided(storage, extent,
    strides, storage_offset + offset)`` ↔ ``count`` elements of the buffer at element ``buffer_offset``
    (relative to the part's first byte), reshaped to ``extent``."""

    extent: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    buffer_offset: int


def part_copies(part: Part, side: str) -> tuple[Copy, ...]:
    """The strided copies that move ``part`` between its message and the ``"source"`` or ``"target"``
    storage: one flat copy where the segment is dense in that storage, else one per box of the run (at
    most ``2·ndim − 1``)."""
    s = part.segment
    if side == "source":
        base, strides = s.source_offset, s.source_strides
    elif side == "target":
        base, strides = s.target_offset, s.target_strides
    else:
        raise ValueError(f"side must be 'source' or 'target', not {side!r}")
    if is_dense(s.extent, strides):
        return (Copy((part.count,), (1,), base + part.start, 0),)
    copies = []
    position = 0
    for box in flat_run_boxes(s.extent, part.start, part.start + part.count):
        offset = base + sum(o * st for o, st in zip(box.origin, strides, strict=True))
        copies.append(Copy(box.extent, strides, offset, position))
        position += box.numel
    return tuple(copies)


def part_runs(part: Part) -> list[tuple[int, int, int]]:
    """The contiguous runs of a pulled part: ``(source element offset, target element offset, count)``,
    one for a part dense on both sides, else one per row of each box of the part."""
    s = part.segment
    if is_dense(s.extent, s.source_strides) and is_dense(s.extent, s.target_strides):
        return [(s.source_offset + part.start, s.target_offset + part.start, part.count)]
    runs = []
    for box in flat_run_boxes(s.extent, part.start, part.start + part.count):
        lead = box.extent[:-1]
        for index in product(*(range(o, o + e) for o, e in zip(box.origin[:-1], lead, strict=True))):
            at = (*index, box.origin[-1])
            src = s.source_offset + sum(i * st for i, st in zip(at, s.source_strides, strict=True))
            dst = s.target_offset + sum(i * st for i, st in zip(at, s.target_strides, strict=True))
            runs.append((src, dst, box.extent[-1]))
    return runs
