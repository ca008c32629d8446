"""Merging workers' target-map parts into fleet maps, and each engine's coverage check
(``rollout_sync.rollout.fleet_maps``), pure: parts are built as the probe builds them."""

from __future__ import annotations

import pytest

from rollout_sync.errors import HoleError, LayoutError, OverlapError
from rollout_sync.layout.box import Box
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.rollout.fleet_maps import assemble
from rollout_sync.rollout.local_targets import LocalTargets, fallback_map
from rollout_sync.rollout.storage_view import StorageView


def part(rank: int, name: str, shape, boxes, param="p", dtype="bfloat16") -> tuple[TensorMap, StorageView]:
    """One rank's part of a map: ``boxes`` stored one after another, row-major, in a flat-range view."""
    pieces = []
    offset = 0
    for origin, extent in boxes:
        strides = (extent[1], 1) if len(extent) == 2 else (1,)
        pieces.append(Piece(Box(origin, extent), offset, strides, (rank,)))
        offset += Box(origin, extent).numel
    storage_shape = (offset // shape[-1], shape[-1]) if len(shape) == 2 else (offset,)
    return TensorMap(name, shape, dtype, {rank: RankStorage(storage_shape, tuple(pieces))}), StorageView(
        param, 0, storage_shape
    )


def worker(rank: int, parts: dict[str, tuple[TensorMap, StorageView]], refused=None) -> LocalTargets:
    return LocalTargets(
        rank, {n: m for n, (m, _) in parts.items()}, {n: v for n, (_, v) in parts.items()}, refused or {}, ()
    )


def tp2_engine(first: int) -> list[LocalTargets]:
    """An engine of 2 workers: q rows split, a norm replicated."""
    return [
        worker(
            first + r,
            {
                "q": part(first + r, "q", (8, 4), [((4 * r, 0), (4, 4))], "qkv"),
                "norm": part(first + r, "norm", (4,), [((0,), (4,))], "norm"),
            },
        )
        for r in range(2)
    ]


def test_replicas_within_and_across_engines_become_holders_of_one_box():
    targets = assemble(tp2_engine(1) + tp2_engine(3), [(1, 2), (3, 4)])
    norm = targets.maps["norm"]
    assert {p.holders for s in norm.ranks.values() for p in s.pieces} == {(1, 2, 3, 4)}
    q = targets.maps["q"]
    assert [q.ranks[r].pieces[0].holders for r in (1, 2, 3, 4)] == [(1, 3), (2, 4), (1, 3), (2, 4)]
    assert targets.engines == ((1, 2), (3, 4))
    assert targets.views[4]["q"] == StorageView("qkv", 0, (4, 4))


def test_an_engine_missing_a_shard_is_refused_naming_the_engine_and_tensor():
    workers = tp2_engine(1)
    workers[1] = worker(2, {"norm": part(2, "norm", (4,), [((0,), (4,))], "norm")})
    with pytest.raises(HoleError, match="engine 0 does not hold every element") as err:
        assemble(workers, [(1, 2)])
    assert err.value.tensor == "q"


def test_overlapping_shards_inside_an_engine_are_refused():
    workers = tp2_engine(1)
    workers[1] = worker(
        2,
        {
            "q": part(2, "q", (8, 4), [((2, 0), (4, 4))], "qkv"),
            "norm": part(2, "norm", (4,), [((0,), (4,))], "norm"),
        },
    )
    with pytest.raises(OverlapError):
        assemble(workers, [(1, 2)])


def test_engine_rank_lists_must_match_the_workers():
    with pytest.raises(LayoutError, match="engine rank lists and worker ranks differ"):
        assemble(tp2_engine(1), [(1, 2, 3)])


def test_a_tensor_staged_whole_on_every_rank_is_covered_and_its_refusals_are_kept_by_rank():
    workers = []
    for r in (0, 1):
        m, v = fallback_map("norm", (4,), "bfloat16", r)
        workers.append(LocalTargets(r, {"norm": m}, {"norm": v}, {"norm": "transforms values"}, ()))
    targets = assemble(workers, [(0, 1)])
    assert targets.refused == {"norm": {0: "transforms values", 1: "transforms values"}}
    assert targets.views[1]["norm"] == StorageView(None, 0, (4,))
    assert {p.holders for s in targets.maps["norm"].ranks.values() for p in s.pieces} == {(0, 1)}
