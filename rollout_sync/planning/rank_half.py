"""One rank plans only its own half: the segments it sends, receives and copies locally, without planning
the rest of the model.

What a rank does at start-up once every rank's maps are known (the handshake hands them out): instead of
the whole plan (every segment of every rank: tens of millions for a 1T-parameter model on hundreds of
GPUs), a rank plans

- as a target, the intersections of its own target regions with every source region, one segment each
  (the source holder chosen by the replica policy);
- as a source, the intersections of the source regions it holds with every target region, keeping the
  segments whose chosen holder is itself.

The result equals ``plan_model(sources, targets, policy).half(rank)`` segment for segment (the tests check
it), provided the policy is **local**: each choice depends only on the request (tensor name, target rank,
box, candidates), never on choices made for other ranks. ``"lowest"`` and ``policy.Spread`` are local;
``"balanced"`` (``policy.Balanced``, greedy over the bytes assigned so far in the whole plan) is not and is
refused here.

Steps mirror the planner's (``rollout_sync.planning.planner``; the shared parts are in ``map_pairs`` and
``segments``): intersections by a sweep, addresses moved to the intersection's origin, one segment per
(intersection, target holder), merging per (source rank, target rank) pair (``merge_segments``), sorting
by target rank, target offset, source rank, source offset. Merging only joins segments between the same
two ranks, so restricting to the segments of one rank merges them exactly as the whole plan does. Coverage
is checked for this rank's own target regions only (the whole plan checks every target region).

Tensors whose segments cannot depend on their name (the ``lowest`` policy, or every source region with one
holder, so no choice is made) and whose maps share their regions objects (the layers of a model, see
``TensorMap``) are planned once per layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from operator import add, mul

from ..errors import CoverageError, ReplicaPolicyError
from ..layout.box import Box
from ..layout.dtypes import ITEMSIZE
from ..layout.maps import TensorMap
from ..layout.sweep import overlapping_pairs
from ..layout.validate import Address, Region
from .half import PlanHalf
from .map_pairs import LayoutKey, SharedLayouts, choice_free, matched_pairs, planned_tensor
from .merge import Raw
from .policy import ReplicaPolicy, ReplicaRequest, check_choice
from .records import PlannedTensor, Segment
from .segments import intersection, sorted_rows

__all__ = ["RankHalf", "choice_free", "matched_pairs", "plan_rank_half", "require_local"]


Row = tuple[int, ...]  # one flat segment record (``rollout_sync.planning.records`` layout)


@dataclass(frozen=True, slots=True)
class RankHalf:
    """The half of one rank, planned by that rank alone, in columnar form.

    ``rows`` holds, for each tensor whose segments involve the rank, ``(tensor index, records)`` with the
    records in plan order (tensors of one layout share one list: do not modify). ``pairs`` are the
    ``(source, target)`` maps in plan order, from which ``tensor_table`` derives the plan's tensor table.
    ``with_digest`` gives the ``PlanHalf`` the executor runs (``Segment`` objects and the tensor table built
    then); the digest is the whole plan's, which only the whole plan can give."""

    rank: int
    pairs: tuple[tuple[TensorMap, TensorMap], ...]
    rows: tuple[tuple[int, list[Row]], ...]

    def tensor_table(self) -> tuple[PlannedTensor, ...]:
        """The plan's tensor table (equal to ``plan_model(...).tensors``)."""
        return tuple(planned_tensor(s, t) for s, t in self.pairs)

    def segments(self) -> tuple[tuple[Segment, ...], tuple[Segment, ...], tuple[Segment, ...]]:
        """``(sends, receives, local)`` as ``Segment`` objects, in plan order."""
        rank = self.rank
        sends: list[Segment] = []
        receives: list[Segment] = []
        local: list[Segment] = []
        for i, rows in self.rows:
            n = len(self.pairs[i][1].shape)
            for r in rows:
                seg = Segment(i, r[0], r[1], r[4 : 4 + n], r[2], r[3], r[4 + n : 4 + 2 * n], r[4 + 2 * n :])
                if r[0] == rank:
                    (local if r[2] == rank else sends).append(seg)
                else:
                    receives.append(seg)
        return tuple(sends), tuple(receives), tuple(local)

    def with_digest(self, digest: str) -> PlanHalf:
        """The executor's ``PlanHalf``, given the whole plan's digest."""
        sends, receives, local = self.segments()
        return PlanHalf(self.rank, digest, self.tensor_table(), sends, receives, local)

    @property
    def segment_count(self) -> int:
        return sum(len(rows) for _, rows in self.rows)

    def traffic(self) -> tuple[int, int, int]:
        """``(bytes sent, bytes received, bytes copied locally)`` in the source dtype (the wire's)."""
        rank = self.rank
        sent = received = copied = 0
        for i, rows in self.rows:
            s, t = self.pairs[i]
            n = len(t.shape)
            size = ITEMSIZE[s.dtype]
            for r in rows:
                nbytes = prod(r[4 + 2 * n :]) * size
                if r[0] != rank:
                    received += nbytes
                elif r[2] == rank:
                    copied += nbytes
                else:
                    sent += nbytes
        return sent, received, copied


def require_local(policy: ReplicaPolicy) -> ReplicaPolicy:
    """``policy`` when one rank can evaluate its choices alone (``"lowest"``, or a callable with a true
    ``local`` attribute and no ``record``), else ``ReplicaPolicyError``."""
    if policy == "lowest":
        return policy
    if callable(policy) and getattr(policy, "local", False) is True and not hasattr(policy, "record"):
        return policy
    raise ReplicaPolicyError(
        "this replica policy depends on the whole plan, so a rank cannot plan its own half alone",
        expected='"lowest" or a local policy such as policy.Spread()',
        found=repr(policy),
    )


def plan_rank_half(
    sources: Sequence[TensorMap],
    targets: Sequence[TensorMap],
    rank: int,
    policy: ReplicaPolicy = "lowest",
) -> RankHalf:
    """The segments ``rank`` sends, receives and copies locally, planned without the rest of the plan.

    ``plan_rank_half(...).with_digest(plan.digest) == plan.half(rank)`` for ``plan = plan_model(sources,
    targets, policy)`` and a local ``policy`` (see ``require_local``)."""
    choose = _chooser(require_local(policy))
    pairs = matched_pairs(sources, targets)
    layouts = SharedLayouts(every_pair=choose is None)
    cache: dict[LayoutKey, list[Row]] = {}
    out: list[tuple[int, list[Row]]] = []
    memo: dict[int, tuple[tuple[Address, ...], tuple[int, ...], dict[int, Address]]] = {}  # see _holders
    for i, (s, t) in enumerate(pairs):
        if rank not in t.storage_shapes and rank not in s.storage_shapes:
            continue
        key = layouts.key(s, t)
        rows = cache.get(key) if key is not None else None
        if rows is None:
            rows = _rank_rows(s, t, rank, choose, memo)
            if key is not None:
                cache[key] = rows
        if rows:
            out.append((i, rows))
    return RankHalf(rank, tuple(pairs), tuple(out))


def _chooser(policy: ReplicaPolicy) -> Callable[[ReplicaRequest], int] | None:
    """None for ``"lowest"`` (the first holder, no request made), else the policy itself."""
    if policy == "lowest" or not callable(policy):
        return None
    return policy


def _rank_rows(
    source: TensorMap,
    target: TensorMap,
    rank: int,
    choose: Callable[[ReplicaRequest], int] | None,
    memo: dict[int, tuple[tuple[Address, ...], tuple[int, ...], dict[int, Address]]],
) -> list[Row]:
    """Sorted flat records (``rollout_sync.planning.records`` layout) of one tensor's segments that ``rank``
    sends or receives."""
    name = target.name
    src = source.regions
    tgt = target.regions
    itemsize = ITEMSIZE[source.dtype]
    is_target = rank in target.storage_shapes
    raw: list[Raw] = []

    if is_target:
        mine = [r for r in tgt if any(a[0] == rank for a in r[2])]
        pairs = overlapping_pairs([(r[0], r[1]) for r in src], [(r[0], r[1]) for r in mine])
        by_target: list[list[int]] = [[] for _ in mine]
        for si, k in pairs:
            by_target[k].append(si)
        for k, (to, te, taddrs) in enumerate(mine):
            addrs = tuple(a for a in taddrs if a[0] == rank)
            got = _emit(name, src, by_target[k], to, te, addrs, itemsize, choose, None, raw, memo)
            if got != prod(te):
                raise CoverageError(
                    "target elements that no source holds",
                    tensor=name,
                    rank=rank,
                    box=Box(to, te),
                    expected=f"{prod(te)} elements held by sources",
                    found=got,
                )

    if rank in source.storage_shapes:
        held = [si for si, r in enumerate(src) if any(a[0] == rank for a in r[2])]
        pairs = overlapping_pairs([(src[si][0], src[si][1]) for si in held], [(r[0], r[1]) for r in tgt])
        by_region: dict[int, list[int]] = {}
        for k, ti in pairs:
            by_region.setdefault(ti, []).append(held[k])
        for ti, sis in by_region.items():
            to, te, taddrs = tgt[ti]
            addrs = tuple(a for a in taddrs if not (is_target and a[0] == rank))  # those are done above
            if addrs:
                _emit(name, src, sis, to, te, addrs, itemsize, choose, rank, raw, memo)

    return sorted_rows(raw, len(target.shape))


def _emit(
    name: str,
    src: tuple[Region, ...],
    sis: list[int],
    to: tuple[int, ...],
    te: tuple[int, ...],
    taddrs: tuple[Address, ...],
    itemsize: int,
    choose: Callable[[ReplicaRequest], int] | None,
    only_source: int | None,
    raw: list[Raw],
    memo: dict[int, tuple[tuple[Address, ...], tuple[int, ...], dict[int, Address]]],
) -> int:
    """Append the raw segments of target region ``(to, te)`` from source regions ``sis`` to the holders
    ``taddrs``, keeping only those whose chosen source is ``only_source`` when given. Returns the elements
    the intersections cover (once, not per holder)."""
    t_end = tuple(map(add, to, te))
    covered = 0
    for si in sorted(sis):
        so, se, saddrs = src[si]
        xo, xe, sdelta, tdelta = intersection(so, se, to, t_end)
        n = prod(xe)
        covered += n
        pick_from = choose if len(saddrs) > 1 else None
        holders: tuple[int, ...] = ()
        by_rank: dict[int, Address] = {}
        if pick_from is not None:
            holders, by_rank = _holders(saddrs, memo)
        box = Box(xo, xe)
        for trank, toff, tstr in taddrs:
            if pick_from is None:
                chosen = saddrs[0]
            else:
                request = ReplicaRequest(name, trank, box, holders, n * itemsize)
                pick = pick_from(request)
                got = by_rank.get(pick) if type(pick) is int else None
                chosen = got if got is not None else by_rank[check_choice(request, pick)]
            if only_source is not None and chosen[0] != only_source:
                continue
            sstr = chosen[2]
            raw.append(
                (
                    chosen[0],
                    chosen[1] + sum(map(mul, sdelta, sstr)),
                    sstr,
                    trank,
                    toff + sum(map(mul, tdelta, tstr)),
                    tstr,
                    xo,
                    xe,
                )
            )
    return covered


def _holders(
    saddrs: tuple[Address, ...],
    memo: dict[int, tuple[tuple[Address, ...], tuple[int, ...], dict[int, Address]]],
) -> tuple[tuple[int, ...], dict[int, Address]]:
    """The holder ranks of a source region and its address by rank, computed once per addresses tuple
    (regions of one layout share theirs)."""
    got = memo.get(id(saddrs))
    if got is None:
        got = memo[id(saddrs)] = (saddrs, tuple(a[0] for a in saddrs), {a[0]: a for a in saddrs})
    return got[1], got[2]
