"""Random layouts and an element-by-element oracle for the planner tests (pure Python, no torch).

The generators are deliberately independent of the production builders (``rollout_sync.layout.builders``):
a layout is drawn as shards of the logical tensor (a TP split along one axis, optionally a second split
along another: column blocks), each shard stored either whole as an N-D tensor (row-major or with permuted
axes, possibly as several pieces, replicated over DP ranks) or cut into flat runs of its row-major
flattening (ZeRO-3 partitions starting mid-row, each run one storage of another ndim than the tensor,
replicated over TP ranks when the tensor is not split). Every storage lives on its own global rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import prod
from typing import Any

from hypothesis import strategies as st

from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.layout.runs import flat_run_boxes
from rollout_sync.planning.policy import Balanced, ReplicaRequest
from rollout_sync.planning.records import Segment


@dataclass(frozen=True)
class Opts:
    flat: bool = True  # ZeRO-3-like flat runs allowed
    nd: bool = True  # whole N-D shards allowed
    transposed: bool = True  # permuted storage axes allowed
    split_pieces: bool = True  # several pieces in one N-D storage
    deepspeed: bool = False  # only what DeepSpeed 0.19.8's planner accepts


ANY = Opts()
ONLY_FLAT = Opts(nd=False)
ONLY_ND = Opts(flat=False)
DEEPSPEED = Opts(transposed=False, deepspeed=True)


@st.composite
def shapes(draw: Any, min_ndim: int = 1, max_ndim: int = 4, max_numel: int = 360) -> tuple[int, ...]:
    ndim = draw(st.integers(min_ndim, max_ndim))
    limit = {1: 40, 2: 18, 3: 8, 4: 5}[ndim] if ndim else 1
    shape = tuple(draw(st.integers(1, limit)) for _ in range(ndim))
    while prod(shape) > max_numel:
        shape = tuple(max(1, x - 1) for x in shape)
    return shape


def _cuts(draw: Any, size: int, max_parts: int) -> list[int]:
    """Sorted cut points 0 = c0 < ... < ck = size (k parts, none empty)."""
    parts = draw(st.integers(1, max(1, min(max_parts, size))))
    inner = (
        draw(st.lists(st.integers(1, size - 1), min_size=parts - 1, max_size=parts - 1, unique=True))
        if size > 1
        else []
    )
    return [0, *sorted(inner), size]


@st.composite
def tensor_maps(
    draw: Any,
    shape: tuple[int, ...],
    first_rank: int = 0,
    opts: Opts = Opts(),
    name: str = "w",
    dtype: str = "float32",
) -> TensorMap:
    ndim = len(shape)
    # --- shards: (origin, extent, tp replicas)
    shards: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    axes = [d for d in range(ndim) if shape[d] > 1]
    split_axis = draw(st.sampled_from([None, *axes])) if axes else None
    if split_axis is None:
        shards.append(((0,) * ndim, shape, draw(st.integers(1, 3))))
    else:
        cuts = _cuts(draw, shape[split_axis], 3)
        second = [d for d in axes if d != split_axis]
        axis2 = draw(st.sampled_from([None, *second])) if second else None
        cuts2 = _cuts(draw, shape[axis2], 3) if axis2 is not None else None
        for a, b in itertools.pairwise(cuts):
            blocks = [(a, b, None, None)]
            if axis2 is not None and cuts2 is not None:
                blocks = [(a, b, c, e) for c, e in itertools.pairwise(cuts2)]
            for lo, hi, lo2, hi2 in blocks:
                origin = [0] * ndim
                extent = list(shape)
                origin[split_axis], extent[split_axis] = lo, hi - lo
                if axis2 is not None and lo2 is not None and hi2 is not None:
                    origin[axis2], extent[axis2] = lo2, hi2 - lo2
                shards.append((tuple(origin), tuple(extent), 1))
    # --- storages: list of (storage shape, [(box, offset, strides)], replica count)
    groups: list[tuple[tuple[int, ...], list[tuple[Box, int, tuple[int, ...]]], int]] = []
    for origin, extent, tp_replicas in shards:
        kinds = []
        if opts.nd:
            kinds.append("nd")
        if opts.flat and (not opts.deepspeed or ndim == 1):
            kinds.append("flat")
        kind = draw(st.sampled_from(kinds))
        if kind == "nd":
            replicas = tp_replicas * draw(st.integers(1, 2))
            groups.append((*_nd_storage(draw, origin, extent, opts), replicas))
        else:
            numel = prod(extent)
            cuts = [0, *sorted(draw(st.lists(st.integers(0, numel), max_size=4))), numel]
            for a, b in itertools.pairwise(cuts):
                if a == b and not draw(st.booleans()):
                    continue  # keep some empty partitions (a rank whose partition is all padding)
                groups.append((*_flat_storage(draw, origin, extent, a, b, opts), tp_replicas))
    # --- ranks
    count = sum(g[2] for g in groups)
    ranks = draw(st.permutations(list(range(first_rank, first_rank + count))))
    storages: dict[int, RankStorage] = {}
    pos = 0
    for sshape, pieces, replicas in groups:
        holders = tuple(sorted(ranks[pos : pos + replicas]))
        pos += replicas
        built = tuple(Piece(box, off, strides, holders) for box, off, strides in pieces)
        for r in holders:
            storages[r] = RankStorage(sshape, built)
    return TensorMap(name, shape, dtype, storages)


def _nd_storage(
    draw: Any, origin: tuple[int, ...], extent: tuple[int, ...], opts: Opts
) -> tuple[tuple[int, ...], list[tuple[Box, int, tuple[int, ...]]]]:
    ndim = len(extent)
    perm = list(range(ndim))
    if opts.transposed and not opts.deepspeed and ndim > 1:
        perm = list(draw(st.permutations(perm)))
    sshape = tuple(extent[perm[a]] for a in range(ndim))
    sstrides = row_major_strides(sshape)
    stride_of = [0] * ndim  # tensor axis -> storage stride
    for a in range(ndim):
        stride_of[perm[a]] = sstrides[a]
    # sub-boxes of the shard (shard-local origins)
    locals_: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((0,) * ndim, extent)]
    splittable = [d for d in range(ndim) if extent[d] > 1]
    if opts.split_pieces and splittable and draw(st.booleans()):
        d = draw(st.sampled_from(splittable))
        cuts = _cuts(draw, extent[d], 3)
        locals_ = []
        for a, b in itertools.pairwise(cuts):
            lo = [0] * ndim
            ex = list(extent)
            lo[d], ex[d] = a, b - a
            locals_.append((tuple(lo), tuple(ex)))
    pieces = []
    for lo, ex in locals_:
        off = sum(lo[d] * stride_of[d] for d in range(ndim))
        box = Box(tuple(o + x for o, x in zip(origin, lo, strict=True)), ex)
        pieces.append((box, off, tuple(stride_of)))
    return sshape, pieces


def _flat_storage(
    draw: Any, origin: tuple[int, ...], extent: tuple[int, ...], start: int, stop: int, opts: Opts
) -> tuple[tuple[int, ...], list[tuple[Box, int, tuple[int, ...]]]]:
    ndim = len(extent)
    n = stop - start
    if opts.deepspeed:
        sshape: tuple[int, ...] = (n,)
    else:
        choices = [s for s in ((n,), (1, n), (1, 1, n)) if len(s) != ndim]
        sshape = draw(st.sampled_from(choices))
    pieces = []
    pos = 0
    for b in flat_run_boxes(extent, start, stop):
        box = Box(tuple(o + x for o, x in zip(origin, b.origin, strict=True)), b.extent)
        pieces.append((box, pos, row_major_strides(b.extent)))
        pos += b.numel
    return sshape, pieces


@st.composite
def layout_pairs(draw, src_opts: Opts = ANY, tgt_opts: Opts = ANY, min_ndim: int = 1, max_ndim: int = 4):
    shape = draw(shapes(min_ndim, max_ndim))
    source = draw(tensor_maps(shape, 0, src_opts))
    colocated = draw(st.booleans())
    first = 0 if colocated else len(source.ranks)
    target = draw(tensor_maps(shape, first, tgt_opts))
    return source, target


@st.composite
def policies(draw: Any) -> Any:
    """``"lowest"``, ``"balanced"``, a ``Balanced`` instance, or a callable choosing a random holder."""
    kind = draw(st.sampled_from(["lowest", "balanced", "instance", "random"]))
    if kind == "instance":
        return Balanced()
    if kind != "random":
        return kind
    seed = draw(st.integers(0, 1 << 30))

    def pick(request: ReplicaRequest) -> int:
        h = hash((seed, request.target_rank, request.box.origin)) % len(request.candidates)
        return request.candidates[h]

    return pick


# ------------------------------------------------------------------------------------------------ fixed maps


def whole(name: str, shape: tuple[int, ...], ranks: list[int], dtype: str = "float32") -> TensorMap:
    """Every rank of ``ranks`` holds the whole tensor, row-major (all are holders)."""
    holders = tuple(sorted(ranks))
    piece = Piece(Box((0,) * len(shape), shape), 0, row_major_strides(shape), holders)
    return TensorMap(name, shape, dtype, {r: RankStorage(shape, (piece,)) for r in ranks})


def rows(name: str, shape: tuple[int, int], ranks: list[int], dtype: str = "float32") -> TensorMap:
    """Rank ``ranks[i]`` holds the i-th equal block of rows."""
    per = shape[0] // len(ranks)
    return TensorMap(
        name,
        shape,
        dtype,
        {
            r: RankStorage(
                (per, shape[1]), (Piece(Box((i * per, 0), (per, shape[1])), 0, (shape[1], 1), (r,)),)
            )
            for i, r in enumerate(ranks)
        },
    )


def flat_runs(name: str, shape: tuple[int, ...], cuts: list[int], ranks: list[int]) -> TensorMap:
    """ZeRO-3-like: rank ``ranks[i]`` holds flat elements ``[cuts[i], cuts[i+1])`` as a 1-D storage."""
    storages = {}
    for i, r in enumerate(ranks):
        pieces = []
        pos = 0
        for b in flat_run_boxes(shape, cuts[i], cuts[i + 1]):
            pieces.append(Piece(b, pos, row_major_strides(b.extent), (r,)))
            pos += b.numel
        storages[r] = RankStorage((cuts[i + 1] - cuts[i],), tuple(pieces))
    return TensorMap(name, shape, "float32", storages)


# ------------------------------------------------------------------------------------------------ oracle


def box_offsets(offset: int, strides: tuple[int, ...], extent: tuple[int, ...]) -> Iterable[int]:
    """Storage offset of every element of an ``as_strided`` view, in row-major order of the view."""
    for index in itertools.product(*(range(e) for e in extent)):
        yield offset + sum(i * s for i, s in zip(index, strides, strict=True))


def logical_index(origin: tuple[int, ...], extent: tuple[int, ...], shape: tuple[int, ...]) -> Iterable[int]:
    full = row_major_strides(shape)
    for index in itertools.product(*(range(e) for e in extent)):
        yield sum((o + i) * s for o, i, s in zip(origin, index, full, strict=True))


def storage_contents(tmap: TensorMap) -> dict[int, list[int]]:
    """Each rank's storage as a flat list holding logical flat indices (-1 where nothing is described)."""
    out: dict[int, list[int]] = {}
    for rank, storage in tmap.ranks.items():
        buf = [-1] * prod(storage.shape)
        for p in storage.pieces:
            for addr, value in zip(
                box_offsets(p.offset, p.strides, p.box.extent),
                logical_index(p.box.origin, p.box.extent, tmap.shape),
                strict=True,
            ):
                buf[addr] = value
        out[rank] = buf
    return out


def apply_segments(
    segments: Iterable[Segment],
    sources: dict[str, TensorMap],
    targets: dict[str, TensorMap],
    names: Callable[[int], str],
) -> tuple[dict[tuple[str, int], list[int]], dict[tuple[str, int], list[int]]]:
    """Run segments element by element: (target storages, write counts) keyed by (tensor, rank)."""
    src = {name: storage_contents(m) for name, m in sources.items()}
    out: dict[tuple[str, int], list[int]] = {}
    writes: dict[tuple[str, int], list[int]] = {}
    for name, m in targets.items():
        for rank, storage in m.ranks.items():
            out[(name, rank)] = [-2] * prod(storage.shape)
            writes[(name, rank)] = [0] * prod(storage.shape)
    for s in segments:
        name = names(s.tensor)
        buf = src[name][s.source_rank]
        dst = out[(name, s.target_rank)]
        cnt = writes[(name, s.target_rank)]
        for a, b in zip(
            box_offsets(s.source_offset, s.source_strides, s.extent),
            box_offsets(s.target_offset, s.target_strides, s.extent),
            strict=True,
        ):
            dst[b] = buf[a]
            cnt[b] += 1
    return out, writes


def check_plan_fills_targets(
    segments: Iterable[Segment],
    sources: list[TensorMap],
    targets: list[TensorMap],
    names: Callable[[int], str],
) -> None:
    """Every target element receives exactly one write, of the logical element its map says it holds."""
    src = {m.name: m for m in sources}
    tgt = {m.name: m for m in targets}
    out, writes = apply_segments(segments, src, tgt, names)
    for m in targets:
        expected = storage_contents(m)
        for rank, want in expected.items():
            got = out[(m.name, rank)]
            assert got == want, f"{m.name} rank {rank}: {got} != {want}"
            assert all(c == 1 for c in writes[(m.name, rank)]), (
                f"{m.name} rank {rank}: {writes[(m.name, rank)]}"
            )


def element_routes(segments: Iterable[Segment]) -> dict[tuple[int, int, int], tuple[int, int]]:
    """(tensor, target rank, target offset) -> (source rank, source offset) for every moved element."""
    routes: dict[tuple[int, int, int], tuple[int, int]] = {}
    for s in segments:
        for a, b in zip(
            box_offsets(s.source_offset, s.source_strides, s.extent),
            box_offsets(s.target_offset, s.target_strides, s.extent),
            strict=True,
        ):
            key = (s.tensor, s.target_rank, b)
            assert key not in routes, f"element {key} written twice"
            routes[key] = (s.source_rank, a)
    return routes
