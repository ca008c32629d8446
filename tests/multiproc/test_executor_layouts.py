"""Random layouts with a known answer, for the executor tests, and the checks that the answer is right.

A ``Scenario`` is a plan (tensor table + segments) built from explicit per-rank pieces of a few logical
tensors, plus what each rank must find in its storages afterwards. The segments come from a small
reference pairing written here (intersect every target piece with the source piece of the chosen holder);
the tests of real planner plans live in ``test_executor_planner.py``. Values: logical tensor ``i`` is
``arange``-based with a random sign and scale per seed, so every element is distinct and a misplaced
element is seen.

Families of storage per side (ranks of the side, shape ``(R, C)`` or ``(N,)``):
``replicated``, ``rows`` (uneven row split), ``cols`` (uneven column split), ``flat`` (ZeRO-3: row-major
flattening cut into equal runs, 1-D storage, last one short), ``transposed`` (row split stored column-major:
permuted strides), ``padded`` (row split with extra rows after the piece that no plan element touches).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from math import prod

import torch

from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.runs import flat_run_boxes
from rollout_sync.planning.plan import PlanHalf, PlannedTensor, Segment

FAMILIES = ("replicated", "rows", "cols", "flat", "transposed", "padded")
POISON = float("nan")


@dataclass(frozen=True)
class Piece:
    rank: int
    box: Box
    offset: int
    strides: tuple[int, ...]


@dataclass
class TensorLayout:
    name: str
    shape: tuple[int, ...]
    source_dtype: str
    target_dtype: str
    source_storage: dict[int, tuple[int, ...]] = field(default_factory=dict)
    target_storage: dict[int, tuple[int, ...]] = field(default_factory=dict)
    source_pieces: list[Piece] = field(default_factory=list)
    target_pieces: list[Piece] = field(default_factory=list)


@dataclass
class Scenario:
    world: int
    seed: int
    layouts: list[TensorLayout]
    segments: list[Segment]

    @property
    def tensors(self) -> tuple[PlannedTensor, ...]:
        return tuple(
            PlannedTensor(
                t.name, t.shape, t.source_dtype, t.target_dtype, dict(t.source_storage), dict(t.target_storage)
            )
            for t in self.layouts
        )

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr((self.tensors, self.segments)).encode()).hexdigest()

    def half(self, rank: int) -> PlanHalf:
        return PlanHalf(
            rank=rank,
            digest=self.digest,
            tensors=self.tensors,
            sends=tuple(s for s in self.segments if s.source_rank == rank != s.target_rank),
            receives=tuple(s for s in self.segments if s.target_rank == rank != s.source_rank),
            local=tuple(s for s in self.segments if s.source_rank == rank == s.target_rank),
        )


def _cuts(total: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """``parts`` consecutive non-empty ranges covering ``[0, total)`` (uneven)."""
    points = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    edges = [0, *points, total]
    return list(zip(edges, edges[1:], strict=False))


def _side(
    family: str, shape: tuple[int, ...], ranks: list[int], rng: random.Random
) -> tuple[dict[int, tuple[int, ...]], list[Piece]]:
    storage: dict[int, tuple[int, ...]] = {}
    pieces: list[Piece] = []
    n = len(ranks)
    if family == "replicated" or (len(shape) == 1 and family in ("cols", "transposed")):
        for r in ranks:
            storage[r] = shape
            pieces.append(Piece(r, Box((0,) * len(shape), shape), 0, row_major_strides(shape)))
    elif family == "flat":
        numel = prod(shape)
        per = -(-numel // n)
        strides = row_major_strides(shape)
        for i, r in enumerate(ranks):
            start, stop = min(i * per, numel), min((i + 1) * per, numel)
            storage[r] = (stop - start,)
            for box in flat_run_boxes(shape, start, stop):
                flat = sum(o * s for o, s in zip(box.origin, strides, strict=True))
                pieces.append(Piece(r, box, flat - start, strides))
    elif family in ("rows", "padded", "transposed"):
        rest = shape[1:]
        for r, (a, b) in zip(ranks, _cuts(shape[0], n, rng), strict=True):
            box = Box((a, *(0,) * len(rest)), (b - a, *rest))
            if family == "transposed":
                storage[r] = (rest[0], b - a)
                pieces.append(Piece(r, box, 0, (1, b - a)))
            else:
                pad = rng.randint(1, 3) if family == "padded" else 0
                storage[r] = (b - a + pad, *rest)
                pieces.append(Piece(r, box, 0, row_major_strides(storage[r])))
    elif family == "cols":
        rows, cols = shape
        for r, (a, b) in zip(ranks, _cuts(cols, n, rng), strict=True):
            storage[r] = (rows, b - a)
            pieces.append(Piece(r, Box((0, a), (rows, b - a)), 0, (b - a, 1)))
    else:
        raise ValueError(family)
    return storage, pieces


def pair(layout: TensorLayout, index: int, spread: bool = True) -> list[Segment]:
    """Reference pairing: every target piece takes each of its elements from one holder of a source piece
    with the same box (holders of one box chosen round robin by target rank when ``spread``)."""
    by_box: dict[Box, list[Piece]] = {}
    for p in layout.source_pieces:
        by_box.setdefault(p.box, []).append(p)
    segments = []
    for tp in layout.target_pieces:
        for box, holders in by_box.items():
            common = tp.box.intersect(box)
            if common is None:
                continue
            sp = holders[tp.rank % len(holders)] if spread else holders[0]
            s_off = sp.offset + sum((c - o) * st for c, o, st in zip(common.origin, sp.box.origin, sp.strides, strict=True))
            t_off = tp.offset + sum((c - o) * st for c, o, st in zip(common.origin, tp.box.origin, tp.strides, strict=True))
            segments.append(Segment(index, sp.rank, s_off, sp.strides, tp.rank, t_off, tp.strides, common.extent))
    return segments


def random_scenario(
    seed: int,
    world: int,
    *,
    tensors: int = 4,
    max_rows: int = 40,
    max_cols: int = 24,
    dtypes: tuple[tuple[str, str], ...] = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")),
    source_ranks: list[int] | None = None,
    target_ranks: list[int] | None = None,
) -> Scenario:
    rng = random.Random(seed)
    layouts = []
    segments: list[Segment] = []
    for i in range(tensors):
        if rng.random() < 0.25:
            shape: tuple[int, ...] = (rng.randint(world, max_rows * max_cols),)
        else:
            shape = (rng.randint(world, max_rows), rng.randint(world, max_cols))
        src = source_ranks or sorted(rng.sample(range(world), rng.randint(1, world)))
        tgt = target_ranks or sorted(rng.sample(range(world), rng.randint(1, world)))
        sdt, tdt = rng.choice(dtypes)
        layout = TensorLayout(f"t{i}.weight", shape, sdt, tdt)
        layout.source_storage, layout.source_pieces = _side(
            rng.choice(("replicated", "rows", "cols", "flat", "transposed")), shape, src, rng
        )
        layout.target_storage, layout.target_pieces = _side(rng.choice(FAMILIES), shape, tgt, rng)
        layouts.append(layout)
        segments += pair(layout, i)
    return Scenario(world, seed, layouts, segments)


def logical_value(scenario: Scenario, index: int) -> torch.Tensor:
    """The logical tensor ``index`` (float64, distinct elements; exactly representable in bf16 only for small
    magnitudes, which is what the cast tests want)."""
    layout = scenario.layouts[index]
    g = torch.Generator().manual_seed(scenario.seed * 1000 + index)
    numel = prod(layout.shape)
    values = torch.arange(1, numel + 1, dtype=torch.float64) * (1.0 + torch.rand(numel, generator=g, dtype=torch.float64))
    return values.view(layout.shape)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def make_storages(scenario: Scenario, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's source storages (pieces filled with the logical values, the rest with -7) and target
    storages (poisoned with NaN)."""
    sources: dict[str, torch.Tensor] = {}
    targets: dict[str, torch.Tensor] = {}
    for i, t in enumerate(scenario.layouts):
        if rank in t.source_storage:
            storage = torch.full(t.source_storage[rank], -7.0, dtype=_dtype(t.source_dtype))
            full = logical_value(scenario, i).to(_dtype(t.source_dtype))
            for p in t.source_pieces:
                if p.rank == rank:
                    view = torch.as_strided(storage, p.box.extent, p.strides, p.offset)
                    view.copy_(full[tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))])
            sources[t.name] = storage
        if rank in t.target_storage:
            targets[t.name] = torch.full(t.target_storage[rank], POISON, dtype=_dtype(t.target_dtype))
    return sources, targets


def expected_targets(scenario: Scenario, rank: int) -> dict[str, torch.Tensor]:
    """What this rank's target storages must hold: every planned element equal to the logical value cast
    source dtype → target dtype (as ``tensor.to`` does), every other element still NaN."""
    out: dict[str, torch.Tensor] = {}
    for i, t in enumerate(scenario.layouts):
        if rank not in t.target_storage:
            continue
        storage = torch.full(t.target_storage[rank], POISON, dtype=_dtype(t.target_dtype))
        full = logical_value(scenario, i).to(_dtype(t.source_dtype)).to(_dtype(t.target_dtype))
        for p in t.target_pieces:
            if p.rank == rank:
                view = torch.as_strided(storage, p.box.extent, p.strides, p.offset)
                view.copy_(full[tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))])
        out[t.name] = storage
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- checks of the reference pairing itself (pure, one process) ------------------------------------------


def _covered(scenario: Scenario, index: int, rank: int) -> dict[int, int]:
    """Target storage element → how many segments write it."""
    hits: dict[int, int] = {}
    for s in scenario.segments:
        if s.tensor != index or s.target_rank != rank:
            continue
        for flat in range(s.numel):
            coords = []
            for e in reversed(s.extent):
                coords.append(flat % e)
                flat //= e
            coords.reverse()
            at = s.target_offset + sum(c * st for c, st in zip(coords, s.target_strides, strict=True))
            hits[at] = hits.get(at, 0) + 1
    return hits


def test_the_reference_pairing_writes_every_planned_target_element_exactly_once() -> None:
    for seed in range(30):
        sc = random_scenario(seed, world=4)
        for i, t in enumerate(sc.layouts):
            for rank in t.target_storage:
                hits = _covered(sc, i, rank)
                planned = sum(p.box.numel for p in t.target_pieces if p.rank == rank)
                assert sum(hits.values()) == planned
                assert set(hits.values()) <= {1}


def test_the_expected_targets_differ_from_the_poisoned_storage_wherever_a_piece_lies() -> None:
    sc = random_scenario(3, world=3)
    for rank in range(3):
        _, targets = make_storages(sc, rank)
        expected = expected_targets(sc, rank)
        for name, storage in targets.items():
            layout = next(t for t in sc.layouts if t.name == name)
            planned = sum(p.box.numel for p in layout.target_pieces if p.rank == rank)
            assert int((~torch.isnan(expected[name])).sum()) == planned
            assert bool(torch.isnan(storage).all())
