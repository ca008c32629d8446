"""Renumbering and merging per-rank parts of a map."""

from __future__ import annotations

import pytest

from rollout_sync.errors import ShapeMismatchError
from rollout_sync.layout import Box, Piece, RankStorage, TensorMap
from rollout_sync.layout.combine import merge, renumber


def kv_part(rank: int, head: int) -> TensorMap:
    """A worker that holds one KV head (rows head*4 : head*4+4) of an [8, 3] tensor, as its own storage."""
    box = Box((head * 4, 0), (4, 3))
    return TensorMap(
        "k_proj.weight", (8, 3), "bfloat16", {rank: RankStorage((4, 3), (Piece(box, 0, (3, 1), (rank,)),))}
    )


def test_ranks_holding_the_same_box_become_its_holders_after_a_merge():
    # TP 4 over 2 KV heads: workers 0 and 1 hold head 0, workers 2 and 3 hold head 1.
    merged = merge([kv_part(0, 0), kv_part(1, 0), kv_part(2, 1), kv_part(3, 1)])
    assert [p.holders for r in range(4) for p in merged.ranks[r].pieces] == [(0, 1), (0, 1), (2, 3), (2, 3)]


def test_renumbering_moves_storages_and_holders_to_global_ranks():
    merged = merge([kv_part(0, 0), kv_part(1, 0)])
    moved = renumber(merged, {0: 5, 1: 6})
    assert sorted(moved.ranks) == [5, 6]
    assert moved.ranks[6].pieces[0].holders == (5, 6)
    assert moved.ranks[5].shape == (4, 3)


def test_parts_of_different_tensors_or_the_same_rank_twice_are_refused():
    other = TensorMap("k_proj.weight", (8, 4), "bfloat16", {1: kv_part(1, 0).ranks[1]})
    with pytest.raises(ShapeMismatchError, match="disagree about the logical tensor"):
        merge([kv_part(0, 0), other])
    with pytest.raises(ShapeMismatchError, match="same rank"):
        merge([kv_part(0, 0), kv_part(0, 1)])
