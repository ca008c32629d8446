"""Incomplete targets are refused before any plan: a target map whose boxes leave elements of its tensor to
no rank (``HoleError`` from the planner, naming the first uncovered position), and an engine whose workers
leave elements uncovered (``check_engine_coverage``, naming the engine too). The three cases of the issue: a
missing TP rank (here as a DeepSpeed map converted through the interop), a missing expert, a half-covered
vocab shard. The handshake's refusal is tested between processes (tests/multiproc/test_session.py) and on
real engines' maps (tests/vllm/test_fast_targets.py)."""

from __future__ import annotations

import os

import pytest

from rollout_sync.errors import CoverageError, HoleError
from rollout_sync.geometry import trainer_maps, vllm_target_maps
from rollout_sync.layout.box import Box
from rollout_sync.layout.coverage import check_engine_coverage
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.layout.sweep import first_uncovered
from rollout_sync.planning.planner import plan_model, plan_tensor
from rollout_sync.shapes import model_tensors

CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 1000,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "num_experts": 4,
    "moe_intermediate_size": 8,
    "tie_word_embeddings": False,
}


def _without(m: TensorMap, rank: int) -> TensorMap:
    """``m`` with ``rank``'s storage gone (and ``rank`` no longer a holder of anything)."""
    return TensorMap(
        m.name,
        m.shape,
        m.dtype,
        {
            r: RankStorage(
                s.shape,
                tuple(
                    Piece(p.box, p.offset, p.strides, tuple(h for h in p.holders if h != rank))
                    for p in s.pieces
                ),
            )
            for r, s in m.ranks.items()
            if r != rank
        },
    )


def test_first_uncovered_is_the_first_hole_in_row_major_order():
    assert first_uncovered((4, 4), [((0, 0), (4, 4))]) is None
    assert first_uncovered((4, 4), [((0, 0), (2, 4)), ((3, 0), (1, 4))]) == (2, 0)
    assert first_uncovered((4, 4), [((0, 0), (4, 2)), ((0, 2), (4, 1))]) == (0, 3)
    assert first_uncovered((2, 3, 4), [((0, 0, 0), (2, 3, 4))]) is None
    assert first_uncovered((2, 3, 4), [((0, 0, 0), (1, 3, 4)), ((1, 0, 1), (1, 3, 3))]) == (1, 0, 0)
    assert first_uncovered((5,), []) == (0,)


def test_a_deepspeed_target_map_missing_a_tp_rank_is_refused_by_the_planner():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    affine = pytest.importorskip("deepspeed.checkpoint.affine")
    from rollout_sync.interop.deepspeed_ir import from_deepspeed

    full = affine.contiguous_split_map((8, 4), [4, 4], 0)  # AutoTP-style: rows [0, 4) and [4, 8)
    missing = affine.ParamAffineMap(
        full.logical_shape, {0: full.shard_shapes[0]}, {0: full.pieces_by_rank[0]}
    )
    target = from_deepspeed(missing, [5], name="w", dtype="float32")
    source = TensorMap(
        "w", (8, 4), "float32", {0: RankStorage((8, 4), (Piece(Box((0, 0), (8, 4)), 0, (4, 1), (0,)),))}
    )
    with pytest.raises(HoleError, match=r"first uncovered position \[4, 0\]") as err:
        plan_tensor(source, target)
    assert err.value.tensor == "w"


def test_a_missing_expert_and_a_half_covered_vocab_shard_are_refused():
    model = model_tensors(CONFIG)
    sources = trainer_maps(model, 3, 2)
    targets = {m.name: m for m in vllm_target_maps(model, 1, 2, ep=2, first_rank=2)}
    # expert 3 lives on EP rank 1 (global 3) only: without it nobody holds it
    expert = "model.layers.0.mlp.experts.3.down_proj.weight"
    with pytest.raises(HoleError, match=r"first uncovered position \[0, 0\]"):
        plan_model(sources, [*(m for n, m in targets.items() if n != expert), _without(targets[expert], 3)])
    with pytest.raises(CoverageError, match="engine 0 holds none of this tensor"):
        check_engine_coverage({expert: _without(targets[expert], 3)}, [(2, 3)])
    # rank 3's vocab shard holds rows [512, 1000); describe only its first half
    vocab = targets["model.embed_tokens.weight"]
    storage = vocab.ranks[3]
    (piece,) = storage.pieces
    half = Box(piece.box.origin, (244, piece.box.extent[1]))
    cut = TensorMap(
        vocab.name,
        vocab.shape,
        vocab.dtype,
        {**vocab.ranks, 3: RankStorage((244, 16), (Piece(half, 0, piece.strides, (3,)),))},
    )
    with pytest.raises(HoleError, match=r"first uncovered position \[756, 0\]"):
        plan_model(sources, [*(m for n, m in targets.items() if n != vocab.name), cut])
    with pytest.raises(
        HoleError, match=r"engine 0 does not hold every element: first uncovered position \[756, 0\]"
    ):
        check_engine_coverage({vocab.name: cut}, [(2, 3)])


def test_two_engines_are_checked_one_by_one():
    model = model_tensors(CONFIG)
    two = {m.name: m for m in vllm_target_maps(model, 2, 2, first_rank=0)}
    check_engine_coverage(two, [(0, 1), (2, 3)])
    norm = "model.norm.weight"
    # engine 1 loses its copy of the norm on both workers: the union still covers, engine 1 does not
    alone = _without(_without(two[norm], 2), 3)
    with pytest.raises(CoverageError, match="engine 1 holds none of this tensor"):
        check_engine_coverage({norm: alone}, [(0, 1), (2, 3)])
