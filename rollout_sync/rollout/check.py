"""Confirm a worker's target maps against vLLM's loaders, exactly, from a handful of elements (pure).

A *loader trace* (``vllm_plugin.tracing``) runs the model's ``load_weights`` once per logical tensor on
the meta device and records every copy the loader makes from the tensor into a parameter as a pair of
strided views (``TracedCopy``): no element is stored, so it costs no memory and milliseconds per tensor.

``check_targets`` compares the traces with target maps built from shapes (``shape_targets``). Where a
traced copy is a box of the logical tensor, both the copy and each piece of the maps are affine on their
intersection, so they agree everywhere on it if they agree at its origin and one step along each of its
axes: those few positions (and the last one) are compared, per copy and piece, which checks every element
and every shard boundary. Counts close the argument: the copies are disjoint and cover exactly the
elements the maps place on this worker. A disagreement raises ``TargetMismatchError`` naming the tensor,
the rank and the first wrong logical position. A copy that is not a box of the tensor (a loader that
transforms values first, or one that raised on the meta device) cannot be checked this way: the tensor
is returned to the caller, which probes it element by element.

``target_differences`` compares two sets of targets (the fast path's and the full probe's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from ..errors import TargetMismatchError
from ..layout.box import Box, row_major_strides
from ..layout.maps import RankStorage, TensorMap
from ..layout.sweep import first_overlap, first_uncovered
from .local_targets import LocalTargets
from .storage_view import StorageView

__all__ = ["LoaderTrace", "TracedCopy", "canonical_map", "check_targets", "target_differences"]


@dataclass(frozen=True, slots=True)
class TracedCopy:
    """One copy a loader made from a logical tensor into a parameter: element ``j`` (a multi-index of
    ``shape``) of the copied view is the logical tensor's row-major element ``source_offset + Σ
    source_strides·j`` and lands at flat element ``offset + Σ strides·j`` of parameter ``param``."""

    param: str
    shape: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]
    source_offset: int
    source_strides: tuple[int, ...]


@dataclass(frozen=True)
class LoaderTrace:
    """Every copy the loader made for ``tensor`` on this worker, or the ``error`` that kept the trace from
    following it (the loader raised, or transformed the tensor before copying)."""

    tensor: str
    copies: tuple[TracedCopy, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class _Landed:
    copy: TracedCopy
    box: Box
    steps: tuple[int, ...]  # parameter elements per unit of each logical axis


def _as_box(copy: TracedCopy, shape: tuple[int, ...]) -> _Landed | None:
    """The copy as a box of the logical tensor, or None when the copied view is not one."""
    numel = prod(shape)
    if not 0 <= copy.source_offset < max(numel, 1):
        return None
    logical = row_major_strides(shape)
    origin = []
    rest = copy.source_offset
    for stride in logical:
        origin.append(rest // stride if stride else 0)
        rest = rest % stride if stride else rest
    extent = [1] * len(shape)
    steps = [0] * len(shape)
    used: set[int] = set()
    for n, source, dest in zip(copy.shape, copy.source_strides, copy.strides, strict=True):
        if n == 1:
            continue
        axis = next(
            (a for a in range(len(shape)) if logical[a] == source and shape[a] > 1 and a not in used), None
        )
        if axis is None or origin[axis] + n > shape[axis]:
            return None
        used.add(axis)
        extent[axis] = n
        steps[axis] = dest
    return _Landed(copy, Box(tuple(origin), tuple(extent)), tuple(steps))


def _samples(box: Box) -> list[tuple[int, ...]]:
    """Where two maps affine on ``box`` must agree for them to agree everywhere on it: its origin, one
    step along each axis it extends along, and its last element."""
    points = [box.origin]
    for a, e in enumerate(box.extent):
        if e > 1:
            points.append(tuple(o + (1 if i == a else 0) for i, o in enumerate(box.origin)))
    points.append(tuple(o + e - 1 for o, e in zip(box.origin, box.extent, strict=True)))
    return points


def _at(base: int, steps: Sequence[int], origin: Sequence[int], x: Sequence[int]) -> int:
    return base + sum(s * (c - o) for s, c, o in zip(steps, x, origin, strict=True))


def _check_tensor(
    name: str,
    shape: tuple[int, ...],
    storage: RankStorage | None,
    view: StorageView | None,
    trace: LoaderTrace,
    rank: int,
) -> bool:
    if trace.error is not None:
        return False
    landed: list[_Landed] = []
    for copy in trace.copies:
        if prod(copy.shape) == 0:
            continue
        got = _as_box(copy, shape)
        if got is None:
            return False
        landed.append(got)
    if storage is None or view is None:
        if landed:
            first = min(landed, key=lambda x: x.box.origin)
            raise TargetMismatchError(
                f"vLLM's loader writes this tensor on this worker, the maps place none of it here; first "
                f"wrong position {list(first.box.origin)}",
                tensor=name,
                rank=rank,
                expected="no storage on this worker",
                found=f"box {first.box} written into parameter {first.copy.param!r}",
            )
        return True
    wrong: list[tuple[tuple[int, ...], str, str]] = []
    covered = 0
    for item in landed:
        for piece in storage.pieces:
            both = item.box.intersect(piece.box)
            if both is None:
                continue
            covered += both.numel
            for x in _samples(both):
                at = (item.copy.param, _at(item.copy.offset, item.steps, item.box.origin, x))
                want = (view.param, view.offset + _at(piece.offset, piece.strides, piece.box.origin, x))
                if at != want:
                    wrong.append((x, f"{want[0]}[{want[1]}]", f"{at[0]}[{at[1]}]"))
    if wrong:
        x, want_at, got_at = min(wrong)
        raise TargetMismatchError(
            f"vLLM's loader puts an element elsewhere than the maps; first wrong position {list(x)}",
            tensor=name,
            rank=rank,
            expected=f"element {list(x)} at flat element {want_at}",
            found=f"flat element {got_at}",
        )
    pair = first_overlap([(x.box.origin, x.box.extent) for x in landed])
    if pair is not None:
        a, b = (landed[i] for i in pair)
        both = a.box.intersect(b.box)
        raise TargetMismatchError(
            f"vLLM's loader writes some elements twice on this worker, the maps once; first wrong "
            f"position {list(both.origin) if both else None}",
            tensor=name,
            rank=rank,
            expected="each element at one place",
            found=f"box {both} in parameters {a.copy.param!r} and {b.copy.param!r}",
        )
    written = sum(item.box.numel for item in landed)
    held = sum(p.box.numel for p in storage.pieces)
    if covered != written:
        stray, outside = next(
            (x, hole)
            for x in landed
            if (hole := _first_outside(x.box, [p.box for p in storage.pieces])) is not None
        )
        raise TargetMismatchError(
            f"vLLM's loader writes elements the maps do not place on this worker; first wrong position "
            f"{list(outside)}",
            tensor=name,
            rank=rank,
            expected=f"{held} elements in boxes {[str(p.box) for p in storage.pieces]}",
            found=f"box {stray.box} written into parameter {stray.copy.param!r}",
        )
    if covered != held:
        holes = [
            (hole, p)
            for p in storage.pieces
            if (hole := _first_outside(p.box, [x.box for x in landed])) is not None
        ]
        unwritten, piece = min(holes, key=lambda h: h[0])
        raise TargetMismatchError(
            f"the maps place elements on this worker that vLLM's loader does not write here; first wrong "
            f"position {list(unwritten)}",
            tensor=name,
            rank=rank,
            expected=f"box {piece.box} written into parameter {view.param!r}",
            found=f"{written} of {held} elements written",
        )
    return True


def _first_outside(box: Box, others: Sequence[Box]) -> tuple[int, ...] | None:
    """The first position of ``box`` (row-major, logical coordinates) that none of ``others`` (pairwise
    disjoint) contains, or None."""
    inside = []
    for other in others:
        both = box.intersect(other)
        if both is not None:
            inside.append((tuple(o - b for o, b in zip(both.origin, box.origin, strict=True)), both.extent))
    hole = first_uncovered(box.extent, inside)
    return None if hole is None else tuple(h + o for h, o in zip(hole, box.origin, strict=True))


def check_targets(
    targets: LocalTargets, shapes: Mapping[str, tuple[int, ...]], traces: Mapping[str, LoaderTrace]
) -> list[str]:
    """Check ``targets`` (built from shapes) against the loader ``traces`` of the same worker. Raises
    ``TargetMismatchError`` on the first tensor where they disagree; returns the tensors the traces could
    not confirm (to be probed instead), in the order of ``shapes``."""
    unconfirmed = []
    for name, shape in shapes.items():
        trace = traces.get(name, LoaderTrace(name, (), "not traced"))
        tmap = targets.maps.get(name)
        storage = tmap.ranks[targets.rank] if tmap is not None else None
        if not _check_tensor(name, tuple(shape), storage, targets.views.get(name), trace, targets.rank):
            unconfirmed.append(name)
    return unconfirmed


def canonical_map(m: TensorMap) -> Any:
    """A map's content without its representation's freedom: pieces sorted, strides of axes of extent 1
    dropped (they address nothing)."""
    return (
        m.shape,
        m.dtype,
        {
            rank: (
                storage.shape,
                sorted(
                    (
                        p.box.origin,
                        p.box.extent,
                        p.offset,
                        tuple(s if e > 1 else None for s, e in zip(p.strides, p.box.extent, strict=True)),
                        p.holders,
                    )
                    for p in storage.pieces
                ),
            )
            for rank, storage in sorted(m.ranks.items())
        },
    )


def target_differences(a: LocalTargets, b: LocalTargets) -> list[str]:
    """Where two sets of one worker's targets differ (maps, storage views, refused and absent tensors);
    empty when they describe the same storage for every element."""
    out = []
    if a.rank != b.rank:
        out.append(f"rank {a.rank} against {b.rank}")
    for name in sorted(set(a.maps) | set(b.maps)):
        ma, mb = a.maps.get(name), b.maps.get(name)
        if ma is None or mb is None:
            out.append(f"{name}: only in the {'first' if mb is None else 'second'} targets")
        elif canonical_map(ma) != canonical_map(mb):
            out.append(f"{name}: maps differ")
        elif a.views.get(name) != b.views.get(name):
            out.append(f"{name}: storage views differ ({a.views.get(name)} against {b.views.get(name)})")
    if set(a.refused) != set(b.refused):
        out.append(f"refused tensors differ: {sorted(a.refused)} against {sorted(b.refused)}")
    if set(a.absent) != set(b.absent):
        out.append(f"absent tensors differ: {sorted(set(a.absent) ^ set(b.absent))}")
    return out
