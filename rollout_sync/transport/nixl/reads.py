"""What a rollout rank reads from each trainer rank's registered storage in a group-free sync (``nixl``):
pure, computed once per (half, which targets are read in place, staging cap), like a program.

A segment is read **in place** when its target is a storage given to the sync (not one made while it is
written, as a loaded form) in the source's dtype: one descriptor per contiguous run (``copies.part_runs``),
straight from the source storage into the target storage. Any other segment is **staged**: its parts, each
at most the staging cap, are read in row-major order into a staging buffer in the source's dtype and then
copied into the target (``copies.part_copies``), converting the dtype. Staged parts form batches that fit the
staging cap together: at most the cap is staged at once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ...layout.dtypes import itemsize
from ...planning.half import PlanHalf
from ..core.copies import Copy, part_copies, part_runs
from ..core.pair_messages import Part

__all__ = ["InPlace", "ReadPlan", "Staged", "read_plan"]


@dataclass(frozen=True, slots=True)
class InPlace:
    """One segment read straight into its target: runs of ``(source element, target element, count)``."""

    source: int  # the source rank
    name: str
    itemsize: int
    runs: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class Staged:
    """One part of a segment read into staging at byte ``offset`` (in the source dtype), then copied into the
    target by ``copies``."""

    source: int
    name: str
    source_dtype: str
    itemsize: int
    offset: int
    runs: tuple[tuple[int, int, int], ...]  # (source element, element within the part, count)
    copies: tuple[Copy, ...]
    count: int


@dataclass(frozen=True, slots=True)
class ReadPlan:
    in_place: tuple[InPlace, ...]
    batches: tuple[tuple[Staged, ...], ...]
    staging_bytes: int  # the largest batch

    def bytes_from(self) -> dict[int, int]:
        """Bytes read from each source rank per sync."""
        out: dict[int, int] = {}
        for r in self.in_place:
            out[r.source] = out.get(r.source, 0) + sum(c for _, _, c in r.runs) * r.itemsize
        for batch in self.batches:
            for p in batch:
                out[p.source] = out.get(p.source, 0) + p.count * p.itemsize
        return out

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(sorted(self.bytes_from()))


def read_plan(half: PlanHalf, in_place: Collection[str], staging_cap_bytes: int) -> ReadPlan:
    """The reads of ``half``'s received segments; ``in_place``: the targets that may be read into directly
    (given storages of the source's dtype). Local segments have no place here: a group-free sync has every
    trainer rank in another process."""
    direct: list[InPlace] = []
    batches: list[tuple[Staged, ...]] = []
    batch: list[Staged] = []
    used = 0
    # tensor by tensor (then source rank): a target made while it is written (a loaded form) is open briefly
    for s in sorted(half.receives, key=lambda s: (s.tensor, s.source_rank, s.target_offset)):
        t = half.tensors[s.tensor]
        size = itemsize(t.source_dtype)
        numel = s.numel
        if t.name in in_place and t.source_dtype == t.target_dtype:
            direct.append(InPlace(s.source_rank, t.name, size, tuple(part_runs(Part(s, 0, numel, 0)))))
            continue
        step = max(staging_cap_bytes // size, 1)
        for start in range(0, numel, step):
            count = min(step, numel - start)
            if batch and used + count * size > staging_cap_bytes:
                batches.append(tuple(batch))
                batch, used = [], 0
            part = Part(s, start, count, 0)
            runs = _runs_in_order(part)
            batch.append(
                Staged(
                    s.source_rank,
                    t.name,
                    t.source_dtype,
                    size,
                    used,
                    runs,
                    part_copies(part, "target"),
                    count,
                )
            )
            used += count * size
    if batch:
        batches.append(tuple(batch))
    largest = max((sum(p.count * p.itemsize for p in b) for b in batches), default=0)
    return ReadPlan(tuple(direct), tuple(batches), largest)


def _runs_in_order(part: Part) -> tuple[tuple[int, int, int], ...]:
    """``part_runs`` with the target side replaced by the run's position within the part (row-major order of
    the segment's extent), the order a staged read lays the elements out in."""
    at = 0
    out = []
    for src, _, n in part_runs(part):
        out.append((src, at, n))
        at += n
    return tuple(out)
