"""Plans: every point-to-point copy (segment) of a whole model's sync.

A **segment** copies one box from one source rank's storage to one target rank's storage. Both addresses
are ``torch.as_strided`` arguments (offset, strides) relative to the storage views named by the tensor's
entry in ``Plan.tensors``; ``extent`` is the box's shape, shared by both sides. A **plan** holds all
segments of a model, sorted deterministically; a rank's **half** is the segments it sends plus those it
receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod


@dataclass(frozen=True, slots=True)
class Segment:
    tensor: int  # index into Plan.tensors
    source_rank: int
    source_offset: int
    source_strides: tuple[int, ...]
    target_rank: int
    target_offset: int
    target_strides: tuple[int, ...]
    extent: tuple[int, ...]

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


@dataclass(frozen=True, slots=True)
class PlanHalf:
    """The part of a plan one rank executes.

    ``sends``: segments with ``source_rank == rank != target_rank``; ``receives``: ``target_rank == rank !=
    source_rank``; ``local``: both ends on this rank (a copy within the process). ``tensors`` is the whole
    plan's tensor table (segments index into it); ``digest`` is the whole plan's digest, so ranks can check
    they execute halves of the same plan.
    """

    rank: int
    digest: str
    tensors: tuple[PlannedTensor, ...]
    sends: tuple[Segment, ...]
    receives: tuple[Segment, ...]
    local: tuple[Segment, ...]
