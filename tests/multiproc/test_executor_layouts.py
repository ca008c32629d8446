"""Random layouts with a known answer, for the executor tests, and the checks that the answer is right.

A ``Scenario`` is a few logical tensors, each with a random source map and target map (real ``TensorMap``
objects), and the plan the real planner makes of them (``plan_model``). Every rank can rebuild the same
scenario from its seed. Values: logical tensor ``i`` is ``arange``-based with a random factor per element, so
every element is distinct and a misplaced element is seen.

Storage families per side (ranks of the side; shape ``(R, C)`` or ``(N,)``): ``replicated``, ``rows``
(uneven row split), ``cols`` (uneven column split), ``flat`` (ZeRO-3: the row-major flattening cut into
equal runs, 1-D storage, the last one short, possibly empty), ``transposed`` (row split stored
column-major: permuted strides; a one-row part is stored row-major, its strides being ambiguous).

Every target storage is a view in the middle of a larger buffer poisoned with NaN (``target_buffers``), so a
write outside the plan, before or after the storage, is seen too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import pairwise
from math import prod

import torch

from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.layout.runs import flat_run_boxes
from rollout_sync.planning.plan import Plan
from rollout_sync.planning.planner import plan_model

FAMILIES = ("replicated", "rows", "cols", "flat", "transposed")
POISON = float("nan")
MARGIN = 5  # poisoned elements before and after every target storage
DTYPE_PAIRS = (
    ("float32", "float32"),
    ("bfloat16", "bfloat16"),
    ("float32", "bfloat16"),
    ("bfloat16", "float32"),
)


@dataclass(frozen=True)
class Scenario:
    seed: int
    world: int
    sources: tuple[TensorMap, ...]
    targets: tuple[TensorMap, ...]
    policy: str

    def plan(self) -> Plan:
        return plan_model(self.sources, self.targets, self.policy)

    def logical(self, name: str) -> torch.Tensor:
        """Logical tensor ``name`` as float64, distinct elements."""
        index = [m.name for m in self.sources].index(name)
        shape = self.sources[index].shape
        g = torch.Generator().manual_seed(self.seed * 1000 + index)
        numel = prod(shape)
        factor = 1.0 + torch.rand(numel, generator=g, dtype=torch.float64)
        return (torch.arange(1, numel + 1, dtype=torch.float64) * factor).view(shape)


def _cuts(total: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """``parts`` consecutive non-empty ranges covering ``[0, total)`` (uneven)."""
    points = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    edges = [0, *points, total]
    return list(pairwise(edges))


def side_map(
    name: str, shape: tuple[int, ...], dtype: str, family: str, ranks: list[int], rng: random.Random
) -> TensorMap:
    """A map of one storage family over ``ranks``."""
    storages: dict[int, RankStorage] = {}
    n = len(ranks)
    ndim = len(shape)
    if family == "replicated" or (ndim == 1 and family in ("cols", "transposed")):
        whole = Box((0,) * ndim, shape)
        for r in ranks:
            storages[r] = RankStorage(shape, (Piece(whole, 0, row_major_strides(shape), tuple(ranks)),))
    elif family == "flat":
        numel = prod(shape)
        per = -(-numel // n)
        strides = row_major_strides(shape)
        for i, r in enumerate(ranks):
            start, stop = min(i * per, numel), min((i + 1) * per, numel)
            pieces = []
            for box in flat_run_boxes(shape, start, stop):
                flat = sum(o * s for o, s in zip(box.origin, strides, strict=True))
                pieces.append(Piece(box, flat - start, strides, (r,)))
            storages[r] = RankStorage((stop - start,), tuple(pieces))
    elif family in ("rows", "transposed"):
        rest = shape[1:]
        for r, (a, b) in zip(ranks, _cuts(shape[0], n, rng), strict=True):
            box = Box((a, *(0,) * len(rest)), (b - a, *rest))
            if family == "transposed" and b - a > 1:
                storages[r] = RankStorage((rest[0], b - a), (Piece(box, 0, (1, b - a), (r,)),))
            else:
                storages[r] = RankStorage(
                    (b - a, *rest), (Piece(box, 0, row_major_strides((b - a, *rest)), (r,)),)
                )
    elif family == "cols":
        rows, cols = shape
        for r, (a, b) in zip(ranks, _cuts(cols, n, rng), strict=True):
            storages[r] = RankStorage(
                (rows, b - a), (Piece(Box((0, a), (rows, b - a)), 0, (b - a, 1), (r,)),)
            )
    else:
        raise ValueError(family)
    return TensorMap(name, shape, dtype, storages)


def random_scenario(
    seed: int,
    world: int,
    *,
    tensors: int = 4,
    max_rows: int = 40,
    max_cols: int = 24,
    dtypes: tuple[tuple[str, str], ...] = DTYPE_PAIRS,
    source_ranks: list[int] | None = None,
    target_ranks: list[int] | None = None,
) -> Scenario:
    rng = random.Random(seed)
    sources, targets = [], []
    for i in range(tensors):
        if rng.random() < 0.25:
            shape: tuple[int, ...] = (rng.randint(world, max_rows * max_cols),)
        else:
            shape = (rng.randint(world, max_rows), rng.randint(world, max_cols))
        src = source_ranks or sorted(rng.sample(range(world), rng.randint(1, world)))
        tgt = target_ranks or sorted(rng.sample(range(world), rng.randint(1, world)))
        sdt, tdt = rng.choice(dtypes)
        name = f"layers.{i}.weight"
        sources.append(side_map(name, shape, sdt, rng.choice(FAMILIES), src, rng))
        targets.append(side_map(name, shape, tdt, rng.choice(FAMILIES), tgt, rng))
    return Scenario(seed, world, tuple(sources), tuple(targets), rng.choice(("lowest", "balanced")))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _fill(storage: torch.Tensor, m: TensorMap, rank: int, full: torch.Tensor) -> None:
    for p in m.ranks[rank].pieces:
        view = torch.as_strided(storage, p.box.extent, p.strides, storage.storage_offset() + p.offset)
        view.copy_(full[tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))])


def source_storages(sc: Scenario, rank: int) -> dict[str, torch.Tensor]:
    """This rank's source storages, every piece filled with its logical values."""
    out = {}
    for m in sc.sources:
        if rank in m.ranks:
            storage = torch.full(m.ranks[rank].shape, -7.0, dtype=_dtype(m.dtype))
            _fill(storage, m, rank, sc.logical(m.name).to(_dtype(m.dtype)))
            out[m.name] = storage
    return out


def target_buffers(sc: Scenario, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(buffers, storages): each target storage is the middle of a buffer poisoned with NaN, ``MARGIN``
    elements of poison before and after it."""
    buffers, storages = {}, {}
    for m in sc.targets:
        if rank in m.ranks:
            shape = m.ranks[rank].shape
            buf = torch.full((prod(shape) + 2 * MARGIN,), POISON, dtype=_dtype(m.dtype))
            buffers[m.name] = buf
            storages[m.name] = buf[MARGIN : MARGIN + prod(shape)].view(shape)
    return buffers, storages


def expected_buffers(sc: Scenario, rank: int) -> dict[str, torch.Tensor]:
    """What each target buffer must hold after the sync: every planned element equal to the logical value
    cast source dtype → target dtype (``tensor.to`` twice), every other element still NaN."""
    dtype_of = {m.name: m.dtype for m in sc.sources}
    buffers, storages = target_buffers(sc, rank)
    for m in sc.targets:
        if rank in m.ranks:
            full = sc.logical(m.name).to(_dtype(dtype_of[m.name])).to(_dtype(m.dtype))
            _fill(storages[m.name], m, rank, full)
    return buffers


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- checks of the oracle itself (pure, one process) ----------------------------------------------------


def test_every_target_element_of_a_random_scenario_is_planned_exactly_once() -> None:
    for seed in range(25):
        sc = random_scenario(seed, world=4)
        plan = sc.plan()
        for i, t in enumerate(plan.tensors):
            target = next(m for m in sc.targets if m.name == t.name)
            for rank, storage in target.ranks.items():
                hits: dict[int, int] = {}
                for s in plan.tensor_segments(i):
                    if s.target_rank != rank:
                        continue
                    for flat in range(s.numel):
                        at, rest = s.target_offset, flat
                        for e, st in zip(reversed(s.extent), reversed(s.target_strides), strict=True):
                            at += rest % e * st
                            rest //= e
                        hits[at] = hits.get(at, 0) + 1
                assert sorted(hits) == list(range(storage.numel))
                assert set(hits.values()) <= {1}


def test_the_expected_buffers_differ_from_the_poison_exactly_where_pieces_lie() -> None:
    sc = random_scenario(3, world=3)
    for rank in range(3):
        buffers, _ = target_buffers(sc, rank)
        expected = expected_buffers(sc, rank)
        for name, buf in buffers.items():
            target = next(m for m in sc.targets if m.name == name)
            assert int((~torch.isnan(expected[name])).sum()) == target.ranks[rank].numel
            assert bool(torch.isnan(buf).all())
