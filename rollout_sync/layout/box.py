"""Boxes: axis-aligned blocks of a logical tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from ..errors import OutOfBoundsError, ShapeMismatchError


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned block of a logical tensor: elements ``origin[d] <= i[d] < origin[d] + extent[d]``."""

    origin: tuple[int, ...]
    extent: tuple[int, ...]

    def __post_init__(self) -> None:
        origin = self.origin
        extent = self.extent
        if type(origin) is not tuple or type(extent) is not tuple or len(origin) != len(extent):
            raise ShapeMismatchError(
                "a box's origin and extent are tuples of one length",
                expected="tuples",
                found=(origin, extent),
            )
        if min(origin, default=0) < 0 or min(extent, default=0) < 0:
            raise OutOfBoundsError("a box has a negative origin or extent", found=(origin, extent))

    @property
    def ndim(self) -> int:
        return len(self.extent)

    @property
    def numel(self) -> int:
        return prod(self.extent)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + e for o, e in zip(self.origin, self.extent, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common block of two boxes, or None where they share no element."""
        origin = []
        extent = []
        for a0, ae, b0, be in zip(self.origin, self.extent, other.origin, other.extent, strict=True):
            lo = a0 if a0 > b0 else b0
            hi = min(a0 + ae, b0 + be)
            if hi <= lo:
                return None
            origin.append(lo)
            extent.append(hi - lo)
        return Box(tuple(origin), tuple(extent))

    def contains(self, other: Box) -> bool:
        return all(
            a0 <= b0 and b0 + be <= a0 + ae
            for a0, ae, b0, be in zip(self.origin, self.extent, other.origin, other.extent, strict=True)
        )

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + e}" for o, e in zip(self.origin, self.extent, strict=True)) + "]"


def reach(offset: int, extent: Sequence[int], strides: Sequence[int]) -> int:
    """One past the last storage element a strided view touches (``offset`` for an empty view)."""
    if prod(extent) == 0:
        return offset
    return offset + sum((e - 1) * st for e, st in zip(extent, strides, strict=True)) + 1


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous (C-order) tensor of this shape."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(shape[d + 1], 1)
    return tuple(strides)
