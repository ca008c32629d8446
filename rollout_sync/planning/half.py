"""A rank's half of a plan: the segments it sends, receives and copies locally (``Plan.half`` cuts one out
of a whole plan, ``planning.rank_half`` plans one directly, ``planning.wire`` carries one)."""

from __future__ import annotations

from dataclasses import dataclass

from .records import PlannedTensor, Segment

__all__ = ["PlanHalf"]


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
