"""Trainer storage maps from layout facts (pure), checked element by element against buffers built the way
DeepSpeed builds them, independently of the maps: ZeRO-3 partitions cut from the padded flattening of each
shard, ZeRO-1/2 optimizer partitions cut from a flat buffer of concatenated shards, packed experts stacked
in placement order. Plus DeepSpeed's flat-buffer geometry on the layouts measured on a live engine
(notes/deepspeed-on-cpu.md), placements from DeepSpeed's own affine maps, and the engine-level refusals."""

from __future__ import annotations

from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.errors import LayoutError, NotAffineError, UnsupportedLayoutError
from rollout_sync.geometry.deepspeed import param_alignment_for, round_robin_order, zero12_flat_layout
from rollout_sync.layout.shards import Layout, Shard, ShardBlock
from rollout_sync.trainer.engine.refusals import EngineTraits, refuse_engine
from rollout_sync.trainer.facts import LogicalPart, ParamFacts, TrainerFacts, ZeroGroup
from rollout_sync.trainer.naming import autoep_expert_parts, fused_expert_parts, plain_parts
from rollout_sync.trainer.placement import autoep_layout, autotp_layout, replicated_layout, single_layout
from rollout_sync.trainer.storage_maps import state_maps

# --------------------------------------------------------------------------------------------------------
# DeepSpeed's ZeRO-1/2 flat geometry, as measured on a live engine (linear model 10-7-5-3, world 2)
# --------------------------------------------------------------------------------------------------------

LINEAR = [70, 7, 35, 5, 15, 3]


def test_the_flat_buffer_of_a_zero2_group_matches_the_one_measured_on_a_live_engine() -> None:
    assert zero12_flat_layout(LINEAR, 2) == ((0, 70, 77, 112, 117, 132), 136)


def test_parameter_alignment_pads_each_bf16_parameter_to_eight_elements_as_measured() -> None:
    assert param_alignment_for(2, True) == 8 and param_alignment_for(4, True) == 4
    assert param_alignment_for(2, False) == 1
    assert zero12_flat_layout(LINEAR, 2, param_alignment=8) == ((0, 72, 80, 120, 128, 144), 148)


def test_round_robin_puts_every_dp_th_parameter_together_as_measured() -> None:
    order = round_robin_order(6, 2)
    assert order == (0, 2, 4, 1, 3, 5)
    offsets, total = zero12_flat_layout([LINEAR[j] for j in order], 2)
    assert offsets == (0, 70, 105, 120, 127, 132) and total == 136


# --------------------------------------------------------------------------------------------------------
# Oracle: DeepSpeed-style buffers built with numpy, independently of the maps
# --------------------------------------------------------------------------------------------------------


def _shard_values(full: np.ndarray, shard: Shard) -> np.ndarray:
    out = np.full(shard.shape, -1, dtype=np.int64)
    for b in shard.blocks:
        src = tuple(slice(o, o + e) for o, e in zip(b.logical_origin, b.extent, strict=True))
        dst = tuple(slice(o, o + e) for o, e in zip(b.shard_origin, b.extent, strict=True))
        out[dst] = full[src]
    return out


def _rank_buffers(
    facts: TrainerFacts, full: dict[str, np.ndarray], state: str
) -> dict[tuple[str, int], tuple]:
    """(param, rank) -> (buffer, shift): the rank's elements of its shard, as DeepSpeed lays them out."""
    out = {}
    flats: dict[tuple[tuple[int, ...], int, int], np.ndarray] = {}
    if facts.stage in (1, 2) and state != "param":
        # One flat buffer per (group ranks, flat size): shards at their offsets, the rest padding (-2).
        for pf in facts.params:
            for k, shard in pf.placement.shards.items():
                g = pf.zero[k]
                key = (g.ranks, g.flat_numel, k)
                buf = flats.setdefault(key, np.full(g.flat_numel, -2, dtype=np.int64))
                vals = _shard_values(full[pf.name], shard).ravel()
                buf[g.flat_offset : g.flat_offset + vals.size] = vals
    for pf in facts.params:
        for k, shard in pf.placement.shards.items():
            g = pf.zero[k]
            vals = _shard_values(full[pf.name], shard).ravel()
            for i, rank in enumerate(g.ranks):
                if facts.stage == 3:
                    p = -(-vals.size // len(g.ranks))
                    padded = np.concatenate([vals, np.full(p * len(g.ranks) - vals.size, -3)])
                    out[(pf.name, rank)] = (padded[i * p : (i + 1) * p].copy(), -i * p)
                elif state == "param":
                    out[(pf.name, rank)] = (vals.copy(), 0)
                else:
                    part = g.flat_numel // len(g.ranks)
                    buf = flats[(g.ranks, g.flat_numel, k)]
                    out[(pf.name, rank)] = (buf[i * part : (i + 1) * part].copy(), g.flat_offset - i * part)
    return out


def check_against_buffers(facts: TrainerFacts, state: str) -> None:
    full = {
        pf.name: np.arange(prod(pf.shape), dtype=np.int64).reshape(pf.shape) * 7 + 1 for pf in facts.params
    }
    buffers = _rank_buffers(facts, full, state)
    for sm in state_maps(facts, state):
        pf = next(p for p in facts.params if any(part.name == sm.map.name for part in p.parts))
        part = next(p for p in pf.parts if p.name == sm.map.name)
        logical = full[pf.name][tuple(slice(o, o + e) for o, e in zip(part.origin, part.extent, strict=True))]
        logical = logical.reshape(part.shape)
        assert set(sm.local) == set(sm.map.ranks)
        covered = np.zeros(part.shape, dtype=np.int64)
        for rank, storage in sm.map.ranks.items():
            run = sm.local[rank]
            buf, shift = buffers[(run.param, rank)]
            view = buf[run.start + shift : run.stop + shift] if run.stop > run.start else buf[:0]
            view = view.reshape(run.shape)
            assert view.shape == storage.shape
            flat = view.reshape(-1)
            for p in storage.pieces:
                idx = np.full(p.box.extent, p.offset, dtype=np.int64)
                for d, s in enumerate(p.strides):
                    shape = [1] * len(p.box.extent)
                    shape[d] = p.box.extent[d]
                    idx = idx + (np.arange(p.box.extent[d]) * s).reshape(shape)
                box = tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))
                np.testing.assert_array_equal(flat[idx], logical[box])
                if p.holders[0] == rank:
                    covered[box] += 1
        assert (covered == 1).all(), sm.map.name


# --------------------------------------------------------------------------------------------------------
# Random layouts: AutoTP-like placements x ZeRO stages, packed experts x EDP groups
# --------------------------------------------------------------------------------------------------------


@st.composite
def tp_facts(draw: st.DrawFn) -> tuple[TrainerFacts, str]:
    stage = draw(st.sampled_from([0, 1, 2, 3]))
    state = "param" if stage == 0 else draw(st.sampled_from(["param", "fp32", "exp_avg"]))
    tp = draw(st.integers(1, 3))
    dp = draw(st.integers(1, 3))
    table = tuple(tuple(d * tp + t for d in range(dp)) for t in range(tp))
    params = []
    for j in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
        name = f"p{j}"
        split = draw(st.sampled_from(["replicated", *[f"dim{d}" for d in range(ndim)]]))
        if split == "replicated" or tp == 1:
            layout = replicated_layout(name, shape, tp)
        else:
            dim = int(split[3:])
            cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=tp - 1, max_size=tp - 1)))
            bounds = [0, *cuts, shape[dim]]
            shards = {}
            for t in range(tp):
                origin = tuple(bounds[t] if d == dim else 0 for d in range(ndim))
                extent = tuple(bounds[t + 1] - bounds[t] if d == dim else s for d, s in enumerate(shape))
                shards[t] = Shard.of_box(origin, extent)
            layout = Layout(name, shape, shards)
        params.append((name, shape, layout))
    # ZeRO-1/2 flat positions per TP rank, the way DeepSpeed computes them.
    align = draw(st.sampled_from([1, 8]))
    flat = {}
    for t in range(tp):
        numels = [prod(layout.shards[t].shape) for _, _, layout in params]
        flat[t] = zero12_flat_layout(numels, dp, param_alignment=align)
    facts = []
    for j, (name, shape, layout) in enumerate(params):
        zero = {
            t: ZeroGroup(table[t], flat[t][0][j], flat[t][1]) if stage in (1, 2) else ZeroGroup(table[t])
            for t in layout.shards
        }
        facts.append(ParamFacts(name, shape, layout, zero, plain_parts(name, shape)))
    return TrainerFacts(stage, "bfloat16", None if stage == 0 else "float32", tuple(facts)), state


@settings(max_examples=150, deadline=None)
@given(tp_facts())
def test_tp_times_zero_maps_address_the_elements_deepspeed_stores(case: tuple[TrainerFacts, str]) -> None:
    facts, state = case
    check_against_buffers(facts, state)


@st.composite
def expert_facts(draw: st.DrawFn) -> tuple[TrainerFacts, str]:
    stage = draw(st.sampled_from([0, 1, 2, 3]))
    state = "param" if stage == 0 else draw(st.sampled_from(["param", "fp32"]))
    ep = draw(st.integers(1, 3))
    edp = draw(st.integers(1, 3))
    world = ep * edp
    experts = draw(st.integers(ep, 2 * ep + 2))
    perm = draw(st.permutations(range(experts)))
    cuts = sorted(draw(st.lists(st.integers(0, experts), min_size=ep - 1, max_size=ep - 1)))
    bounds = [0, *cuts, experts]
    placement = {
        "num_experts": experts,
        "ranks": [{"rank": k, "experts": list(perm[bounds[k] : bounds[k + 1]])} for k in range(ep)],
    }
    table = tuple(tuple(range(k, world, ep)) for k in range(ep))
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    facts = []
    flat_numels = {}
    packed = [("w1", (experts, rows, cols)), ("w2", (experts, cols, rows))]
    layouts = {n: autoep_layout(n, s, placement) for n, s in packed}
    for k in range(ep):
        numels = [prod(layouts[n].shards[k].shape) for n, _ in packed]
        flat_numels[k] = zero12_flat_layout(numels, edp)
    for j, (name, shape) in enumerate(packed):
        layout = layouts[name]
        zero = {
            k: ZeroGroup(table[k], flat_numels[k][0][j], flat_numels[k][1])
            if stage in (1, 2)
            else ZeroGroup(table[k])
            for k in layout.shards
        }
        facts.append(
            ParamFacts(name, shape, layout, zero, autoep_expert_parts("qwen3_moe", "m", name, shape))
        )
    return TrainerFacts(stage, "bfloat16", None if stage == 0 else "float32", tuple(facts)), state


@settings(max_examples=150, deadline=None)
@given(expert_facts())
def test_packed_expert_maps_address_the_elements_every_edp_rank_stores(
    case: tuple[TrainerFacts, str],
) -> None:
    facts, state = case
    check_against_buffers(facts, state)


# --------------------------------------------------------------------------------------------------------
# Fixed cases
# --------------------------------------------------------------------------------------------------------


def _facts(pf: ParamFacts, stage: int = 3) -> TrainerFacts:
    return TrainerFacts(stage, "bfloat16", "float32", (pf,))


def test_an_all_padding_zero3_partition_is_an_empty_storage() -> None:
    # 5 elements over 4 ranks: partitions of 2; rank 3 holds only padding.
    pf = ParamFacts("b", (5,), single_layout("b", (5,)), {0: ZeroGroup((0, 1, 2, 3))}, plain_parts("b", (5,)))
    (sm,) = state_maps(_facts(pf), "param")
    assert {r: s.shape for r, s in sm.map.ranks.items()} == {0: (2,), 1: (2,), 2: (1,), 3: (0,)}
    assert sm.map.ranks[3].pieces == ()


def test_zero012_replicas_are_all_holders_of_the_whole_tensor() -> None:
    shape = (4, 6)
    pf = ParamFacts("w", shape, single_layout("w", shape), {0: ZeroGroup((0, 1, 2))}, plain_parts("w", shape))
    (sm,) = state_maps(_facts(pf, stage=2), "param")
    for rank in (0, 1, 2):
        (piece,) = sm.map.ranks[rank].pieces
        assert piece.holders == (0, 1, 2) and sm.map.ranks[rank].shape == shape


def test_fused_gate_up_experts_give_per_expert_gate_and_up_halves() -> None:
    parts = fused_expert_parts("model.layers.0.mlp", "gate_up_proj", (3, 8, 5))
    assert [p.name for p in parts[:2]] == [
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
    ]
    up1 = parts[3]
    assert (up1.origin, up1.extent, up1.shape) == ((1, 4, 0), (1, 4, 5), (4, 5))


def test_a_zero3_partition_of_fused_experts_cuts_each_expert_half_into_flat_runs() -> None:
    shape = (3, 8, 5)
    parts = fused_expert_parts("m", "gate_up_proj", shape)
    pf = ParamFacts(
        "m.experts.gate_up_proj", shape, single_layout("x", shape), {0: ZeroGroup((0, 1, 2, 3, 4))}, parts
    )
    check_against_buffers(_facts(pf), "param")


def test_redundant_experts_are_held_by_every_ep_rank_that_packs_them() -> None:
    placement = {"num_experts": 3, "ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [1, 2]}]}
    shape = (3, 2, 2)
    pf = ParamFacts(
        "w1",
        shape,
        autoep_layout("w1", shape, placement),
        {0: ZeroGroup((0, 2)), 1: ZeroGroup((1, 3))},
        autoep_expert_parts("qwen3_moe", "m", "w1", shape),
    )
    maps = {sm.map.name: sm for sm in state_maps(_facts(pf, stage=1), "param")}
    assert maps["m.experts.1.gate_proj.weight"].map.ranks[0].pieces[0].holders == (0, 1, 2, 3)
    assert set(maps["m.experts.0.gate_proj.weight"].map.ranks) == {0, 2}


def test_autotp_layouts_come_from_deepspeeds_own_affine_maps() -> None:
    affine = pytest.importorskip("deepspeed.checkpoint.affine")
    col = autotp_layout("q", affine.contiguous_split_map((6, 4), [4, 2], 0).to_dict())
    assert col.shards[1] == Shard((2, 4), (ShardBlock((0, 0), (4, 0), (2, 4)),))
    row = autotp_layout("o", affine.contiguous_split_map((4, 6), [3, 3], 1).to_dict())
    assert row.shards[1] == Shard((4, 3), (ShardBlock((0, 0), (0, 3), (4, 3)),))
    fused = autotp_layout(
        "qkv", affine.sub_param_map((8, 3), [4, 2, 2], [[2, 2], [1, 1], [1, 1]], 0).to_dict()
    )
    assert fused.shards[1].shape == (4, 3) and len(fused.shards[1].blocks) == 3
    rep = autotp_layout("n", affine.replicated_map((5,), 2).to_dict())
    assert rep.shards[0] == rep.shards[1] == Shard.of_box((0,), (5,))


def test_a_scaled_autotp_shard_is_refused() -> None:
    affine = pytest.importorskip("deepspeed.checkpoint.affine")
    with pytest.raises(UnsupportedLayoutError, match="scaled"):
        autotp_layout("b", affine.replicated_map((4,), 2, scale=0.5).to_dict())


def test_an_autotp_piece_with_foreign_strides_is_refused() -> None:
    bad = {
        "logical_shape": [4, 4],
        "ranks": {
            0: {
                "shard_shape": [4, 4],
                "pieces": [{"shape": [4, 4], "source": [0, [1, 4]], "dest": [0, [4, 1]], "locations": [0]}],
            }
        },
    }
    with pytest.raises(NotAffineError):
        autotp_layout("t", bad)


def test_an_expert_slab_of_a_column_split_shard_is_dense_but_a_row_band_across_experts_is_not() -> None:
    shape = (2, 4, 4)
    cols = Layout("w", shape, {0: Shard.of_box((0, 0, 0), (2, 4, 2)), 1: Shard.of_box((0, 0, 2), (2, 4, 2))})
    experts = (
        LogicalPart("e0", (4, 4), (0, 0, 0), (1, 4, 4)),
        LogicalPart("e1", (4, 4), (1, 0, 0), (1, 4, 4)),
    )
    split = ParamFacts("w", shape, cols, {0: ZeroGroup((0, 2)), 1: ZeroGroup((1, 3))}, experts)
    check_against_buffers(_facts(split), "param")  # expert e of shard [2, 4, 2] is its dense slab [e]
    whole = Layout("w", shape, {0: Shard.of_box((0, 0, 0), shape)})
    band = (LogicalPart("rows", (2, 2, 4), (0, 0, 0), (2, 2, 4)),)
    with pytest.raises(NotAffineError, match="dense block"):
        state_maps(_facts(ParamFacts("w", shape, whole, {0: ZeroGroup((0,))}, band)), "param")


def test_zero0_optimizer_states_are_refused_with_a_clear_error() -> None:
    pf = ParamFacts("w", (4,), single_layout("w", (4,)), {0: ZeroGroup((0, 1))}, plain_parts("w", (4,)))
    with pytest.raises(UnsupportedLayoutError, match="ZeRO-1/2 and ZeRO-3"):
        state_maps(TrainerFacts(0, "bfloat16", "float32", (pf,)), "fp32")


def test_a_shard_past_the_end_of_its_flat_buffer_is_refused() -> None:
    pf = ParamFacts("w", (6,), single_layout("w", (6,)), {0: ZeroGroup((0, 1), 4, 8)}, plain_parts("w", (6,)))
    with pytest.raises(LayoutError, match="past the end"):
        state_maps(_facts(pf, stage=2), "fp32")


def test_a_logical_part_whose_shape_is_not_its_block_is_refused() -> None:
    with pytest.raises(LayoutError):
        LogicalPart("x", (3, 4), (0, 0, 0), (2, 3, 4))


@pytest.mark.parametrize(
    ("traits", "match"),
    [
        (EngineTraits(2, "DeepSpeedZeroOptimizer", offload_optimizer="cpu"), "offloaded optimizer"),
        (EngineTraits(3, "DeepSpeedZeroOptimizer_Stage3", offload_optimizer="nvme"), "offloaded optimizer"),
        (
            EngineTraits(3, "DeepSpeedZeroOptimizer_Stage3", offload_param="nvme"),
            "offloaded ZeRO-3 parameter",
        ),
        (EngineTraits(3, "DeepSpeedZeroOptimizer_Stage3", quantized_weights=True), "quantized"),
        (EngineTraits(3, "MiCS_Optimizer", mics=True), "MiCS"),
        (EngineTraits(3, "DeepSpeedZeroOptimizer_Stage3", hpz_partition_size=2), "hpZ"),
        (EngineTraits(2, "DeepSpeedZeroOptimizer", expert_tensor_parallel=2), "expert tensor parallelism"),
        (EngineTraits(2, "DeepSpeedZeroOptimizer", autoep_with_autotp=True), "AutoEP combined with AutoTP"),
        (EngineTraits(1, "SomeOtherOptimizer"), "optimizer wrapper"),
    ],
)
def test_engines_whose_storage_is_not_described_are_refused_by_name(traits: EngineTraits, match: str) -> None:
    with pytest.raises(UnsupportedLayoutError, match=match):
        refuse_engine(traits)


def test_a_plain_engine_is_not_refused() -> None:
    for stage, opt in (
        (0, "FP16_UnfusedOptimizer"),
        (1, "BF16_Optimizer"),
        (3, "DeepSpeedZeroOptimizer_Stage3"),
    ):
        refuse_engine(EngineTraits(stage, opt))


# --------------------------------------------------------------------------------------------------------
# Dry run: facts from a model config and a layout description alone
# --------------------------------------------------------------------------------------------------------

TINY_DENSE = {
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "tie_word_embeddings": False,
}
TINY_MOE = {
    **TINY_DENSE,
    "model_type": "qwen3_moe",
    "num_local_experts": 8,
    "moe_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


@pytest.mark.parametrize(
    ("config", "stage", "dp", "tp", "ep"),
    [
        (TINY_DENSE, 3, 2, 2, 1),
        (TINY_DENSE, 1, 3, 2, 1),
        (TINY_MOE, 2, 4, 1, 2),
        (TINY_MOE, 3, 4, 1, 2),
        (TINY_MOE, 3, 3, 1, 1),
    ],
)
def test_dry_run_param_maps_equal_the_map_builders_and_every_state_addresses_deepspeed_buffers(
    config: dict, stage: int, dp: int, tp: int, ep: int
) -> None:
    from rollout_sync.geometry import trainer_maps
    from rollout_sync.shapes import model_tensors
    from rollout_sync.trainer.shape_facts import dry_run_facts

    model = model_tensors(config)
    facts = dry_run_facts(model, stage, dp, tp, ep)
    ours = {sm.map.name: sm.map for sm in state_maps(facts, "param")}
    theirs = {m.name: m for m in trainer_maps(model, stage, dp, tp, ep)}
    assert ours == theirs
    for state in ("param", "fp32") if stage else ("param",):
        check_against_buffers(facts, state)


def test_a_dry_run_of_a_tied_embedding_under_autotp_splits_it_like_lm_head() -> None:
    from rollout_sync.shapes import model_tensors
    from rollout_sync.trainer.shape_facts import dry_run_facts

    facts = dry_run_facts(model_tensors({**TINY_DENSE, "tie_word_embeddings": True}), 2, 1, 2)
    (embed,) = (sm.map for sm in state_maps(facts, "param") if sm.map.name == "model.embed_tokens.weight")
    assert [str(p.box) for r in (0, 1) for p in embed.ranks[r].pieces] == [
        "[0:500, 0:128]",
        "[500:1000, 0:128]",
    ]


def test_a_frozen_parameter_has_a_parameter_map_but_no_optimizer_state_maps() -> None:
    frozen = ParamFacts(
        "f", (4,), single_layout("f", (4,)), {0: ZeroGroup((0, 1))}, plain_parts("f", (4,)), trainable=False
    )
    trained = ParamFacts(
        "t", (4,), single_layout("t", (4,)), {0: ZeroGroup((0, 1), 0, 4)}, plain_parts("t", (4,))
    )
    facts = TrainerFacts(2, "bfloat16", "float32", (frozen, trained))
    assert [sm.map.name for sm in state_maps(facts, "param")] == ["f", "t"]
    assert [sm.map.name for sm in state_maps(facts, "exp_avg")] == ["t"]
