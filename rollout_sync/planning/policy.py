"""Replica policies: which holder of a replicated source box serves a target.

The planner asks once per (target rank, intersected box) when the source box has several holders. A policy
is ``"lowest"``, ``"balanced"`` or any callable taking a ``ReplicaRequest`` and returning one of its
``candidates``; anything else it returns is refused with ``ReplicaPolicyError``.

- ``lowest``: the lowest holder rank (DeepSpeed's default).
- ``balanced``: the target rank itself when it holds the box (a copy within one process), else the holder
  with the fewest bytes assigned so far in this plan (ties: the lowest rank). Every assignment the planner
  makes counts, including those of boxes with a single holder. Given ``places`` (rank -> where it runs:
  host and process), the holders nearest the target come first: in the target's own process (a handoff, one
  copy in memory), else on its host, else any.

- ``Spread`` (an instance): balanced without any state, so that one rank can evaluate every choice of its
  own half alone (``rollout_sync.planning.rank_half``): the target rank itself when it holds the box, else
  the holder at index ``(digit_sum(target_rank, base n) + crc32(tensor)) mod n`` of the ``n`` candidates.

A callable may also define ``record(rank, nbytes)``; the planner then calls it for every assignment (as it
does for ``Balanced``), so a stateful policy sees the whole plan's load.
"""

from __future__ import annotations

import zlib
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, Union

from ..errors import ReplicaPolicyError
from ..layout.box import Box


@dataclass(frozen=True, slots=True)
class ReplicaRequest:
    """One choice: which of ``candidates`` (source holder ranks, increasing) sends ``box`` of ``tensor`` to
    ``target_rank``. ``nbytes`` is the size of that copy in source bytes."""

    tensor: str
    target_rank: int
    box: Box
    candidates: tuple[int, ...]
    nbytes: int


class Recorder(Protocol):
    def record(self, rank: int, nbytes: int) -> None: ...


PolicyName = Literal["lowest", "balanced"]
ReplicaPolicy = Union[PolicyName, Callable[[ReplicaRequest], int]]  # noqa: UP007 (runtime alias for 3.10)


def lowest(request: ReplicaRequest) -> int:
    """The lowest holder rank."""
    return request.candidates[0]


class Balanced:
    """Local copy first, else the holder with the fewest bytes assigned so far (ties: lowest rank).

    ``assigned`` counts bytes per source rank over every ``record`` call (the planner records every
    assignment of a plan, chosen or forced). One instance per plan. ``places`` maps a rank to ``(host,
    process)``; ranks it does not name are nowhere in particular.
    """

    __slots__ = ("assigned", "places")

    def __init__(self, places: Mapping[int, tuple[str, int]] | None = None) -> None:
        self.assigned: dict[int, int] = {}
        self.places = dict(places or {})

    def nearest(self, target_rank: int, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """The candidates in the target's process, else on its host, else all of them."""
        where = self.places.get(target_rank)
        if where is None:
            return candidates
        places = self.places
        same_process = tuple(c for c in candidates if places.get(c) == where)
        if same_process:
            return same_process
        same_host = tuple(c for c in candidates if (places.get(c) or ("",))[0] == where[0])
        return same_host or candidates

    def choose(self, target_rank: int, candidates: tuple[int, ...]) -> int:
        if target_rank in candidates:
            return target_rank
        if self.places and len(candidates) > 1:
            candidates = self.nearest(target_rank, candidates)
        assigned = self.assigned
        best = candidates[0]
        best_load = assigned.get(best, 0)
        for rank in candidates[1:]:
            load = assigned.get(rank, 0)
            if load < best_load:
                best, best_load = rank, load
        return best

    def record(self, rank: int, nbytes: int) -> None:
        self.assigned[rank] = self.assigned.get(rank, 0) + nbytes

    def __call__(self, request: ReplicaRequest) -> int:
        return self.choose(request.target_rank, request.candidates)


class Spread:
    """Balanced replica choice that needs no state: every choice depends only on the tensor's name, the
    target rank and the candidates, so the whole plan and one rank planning its own half alone make the same
    choices (``local`` is True; ``rollout_sync.planning.rank_half`` relies on it).

    - The target rank itself when it holds the box (a copy within one process).
    - Else, of the ``n`` candidates, the one at index ``(digit_sum(target_rank, base n) + crc32(tensor))
      mod n``. The base-``n`` digit sum gives distinct indices to ``n`` consecutive target ranks that start
      at a multiple of ``n`` (the TP ranks of an engine) and to ``n`` target ranks ``n**k`` apart whose
      ``k``-th digit starts at 0 (the same TP rank in consecutive engines of ``n**k`` workers), so the
      targets of one tensor spread over its holders; the per-tensor ``crc32`` rotates the start from tensor
      to tensor, so that tensors needed by fewer targets than they have holders still spread their load
      over all holders across the model.

    Unlike ``Balanced`` it does not look at bytes already assigned: its balance is structural (equal shards
    over consecutive ranks), not greedy. Deterministic across processes (``zlib.crc32``, not ``hash``).
    """

    __slots__ = ()

    local = True

    def __call__(self, request: ReplicaRequest) -> int:
        candidates = request.candidates
        target = request.target_rank
        n = len(candidates)
        at = bisect_left(candidates, target)  # candidates are increasing: no linear scan
        if at < n and candidates[at] == target:
            return target
        if n == 1:
            return candidates[0]
        digits = 0
        rest = target
        while rest:
            rest, digit = divmod(rest, n)
            digits += digit
        return candidates[(digits + zlib.crc32(request.tensor.encode())) % n]

    def __repr__(self) -> str:
        return "Spread()"


def check_choice(request: ReplicaRequest, choice: object) -> int:
    """The chosen rank, or ``ReplicaPolicyError`` when it is not one of the candidates."""
    if type(choice) is not int or choice not in request.candidates:
        raise ReplicaPolicyError(
            "the replica policy chose a rank that does not hold the box",
            tensor=request.tensor,
            rank=request.target_rank,
            box=request.box,
            expected=f"one of the holders {list(request.candidates)}",
            found=repr(choice),
        )
    return choice
