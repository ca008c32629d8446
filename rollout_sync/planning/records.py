"""What a plan is made of: its tensor table entries (``PlannedTensor``), its segments (``Segment``) and
the flat integer record of a segment, with the checks that keep a segment inside its storages.

A **segment** copies one box from one source rank's storage to one target rank's storage. Both addresses
are ``torch.as_strided`` arguments (offset, strides) relative to the storage views named by the tensor's
entry in ``Plan.tensors``; ``extent`` is the box's shape, shared by both sides.

A plan (``planning.plan``) keeps its segments as records: fixed-width integers, one ``array('q')`` per
tensor. Record layout for a tensor of ndim ``n`` (width ``record_width(n) = 4 + 3n``)::

    source_rank, source_offset, target_rank, target_offset, source_strides[n], target_strides[n], extent[n]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from types import MappingProxyType

from ..errors import (
    LayoutError,
    OutOfBoundsError,
    PlanMismatchError,
    ShapeMismatchError,
    UnsupportedLayoutError,
)
from ..layout.dtypes import ITEMSIZE

__all__ = ["PlannedTensor", "Segment", "check_record", "check_segment", "record_width"]


@dataclass(frozen=True, slots=True)
class Segment:
    """One box copied from ``source_rank``'s storage to ``target_rank``'s storage (see the module docstring)."""

    tensor: int  # index into Plan.tensors
    source_rank: int
    source_offset: int
    source_strides: tuple[int, ...]
    target_rank: int
    target_offset: int
    target_strides: tuple[int, ...]
    extent: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.extent)
        if len(self.source_strides) != n or len(self.target_strides) != n:
            raise ShapeMismatchError(
                "a segment's strides and extent differ in length",
                expected=n,
                found=(self.source_strides, self.target_strides),
            )
        if (
            min(self.extent, default=1) < 1
            or self.source_offset < 0
            or self.target_offset < 0
            or min(self.source_strides, default=0) < 0
            or min(self.target_strides, default=0) < 0
            or self.tensor < 0
            or self.source_rank < 0
            or self.target_rank < 0
        ):
            raise LayoutError(
                "a segment needs a non-empty extent and non-negative ranks, offsets and strides", found=self
            )

    @property
    def numel(self) -> int:
        return prod(self.extent)


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """What every rank must hold for one logical tensor: its storage shape on each source and target rank."""

    name: str
    shape: tuple[int, ...]
    source_dtype: str
    target_dtype: str
    source_storage: Mapping[int, tuple[int, ...]]  # global rank -> storage shape
    target_storage: Mapping[int, tuple[int, ...]]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError("a planned tensor needs a name", found=self.name)
        for dtype in (self.source_dtype, self.target_dtype):
            if dtype not in ITEMSIZE:
                raise UnsupportedLayoutError("unknown storage dtype", tensor=self.name, found=dtype)
        for which in ("source_storage", "target_storage"):
            table = getattr(self, which)
            if not isinstance(table, MappingProxyType):
                for rank, shape in table.items():
                    if type(rank) is not int or rank < 0 or not isinstance(shape, tuple):
                        raise LayoutError(
                            f"{which} maps global ranks to storage shapes",
                            tensor=self.name,
                            found=(rank, shape),
                        )
                object.__setattr__(self, which, MappingProxyType(dict(sorted(table.items()))))

    def __reduce__(self) -> tuple[type[PlannedTensor], tuple[object, ...]]:
        return (
            PlannedTensor,
            (
                self.name,
                self.shape,
                self.source_dtype,
                self.target_dtype,
                dict(self.source_storage),
                dict(self.target_storage),
            ),
        )


def record_width(ndim: int) -> int:
    """Integers in one segment record of a tensor of ``ndim`` dimensions."""
    return 4 + 3 * ndim


def check_segment(tensor: PlannedTensor, segment: Segment) -> None:
    """Refuse a segment whose ranks have no storage of ``tensor`` or whose views leave their storages."""
    check_record(
        tensor,
        {r: prod(s) for r, s in tensor.source_storage.items()},
        {r: prod(s) for r, s in tensor.target_storage.items()},
        (
            segment.source_rank,
            segment.source_offset,
            segment.target_rank,
            segment.target_offset,
            *segment.source_strides,
            *segment.target_strides,
            *segment.extent,
        ),
    )


def check_record(t: PlannedTensor, snumel: dict[int, int], tnumel: dict[int, int], x: Sequence[int]) -> None:
    """Refuse one record ``x`` of ``t`` that is malformed, names a rank without storage, or whose view leaves
    its storage; ``snumel``/``tnumel`` give each source/target rank's storage size in elements."""
    n = len(t.shape)
    if len(x) != record_width(n):
        raise ShapeMismatchError("a segment's ndim differs from its tensor's", tensor=t.name, expected=n)
    ext = x[4 + 2 * n :]
    if min(ext, default=1) < 1 or min(x[1:], default=0) < 0 or x[0] < 0:
        raise PlanMismatchError(f"tensor {t.name!r}: segment record {list(x)} has a bad value")
    for rank, off, strides, table, side in (
        (x[0], x[1], x[4 : 4 + n], snumel, "source"),
        (x[2], x[3], x[4 + n : 4 + 2 * n], tnumel, "target"),
    ):
        numel = table.get(rank)
        if numel is None:
            raise PlanMismatchError(
                f"tensor {t.name!r}: a segment names {side} rank {rank}, which has no storage"
            )
        reach = off
        for e, s in zip(ext, strides, strict=True):
            reach += (e - 1) * s
        if reach >= numel:
            raise OutOfBoundsError(
                f"a segment's {side} view leaves its storage",
                tensor=t.name,
                rank=rank,
                expected=f"last element < {numel}",
                found=f"offset {off}, strides {tuple(strides)}, extent {tuple(ext)} reach {reach}",
            )
