"""Map builders checked element by element against storages built with numpy the way DeepSpeed and vLLM
build them (``test_nesting.check_storages``)."""

from __future__ import annotations

from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_nesting import arange, check_storages, check_tiling, zero3_parts

from rollout_sync.errors import LayoutError
from rollout_sync.geometry.deepspeed import (
    autotp_shard_sizes,
    tp_zero_map,
    zero3_map,
    zero3_partition_numel,
    zero3_runs,
    zero_replica_map,
)
from rollout_sync.geometry.vllm import (
    vllm_column_map,
    vllm_expert_map,
    vllm_expert_owner,
    vllm_gate_up_part_map,
    vllm_qkv_part_map,
    vllm_replicated_map,
    vllm_row_map,
    vllm_vocab_map,
    vllm_vocab_rows,
)
from rollout_sync.layout.builders import (
    even_sizes,
    replicated_layout,
    replicated_map,
    split_layout,
    split_map,
    sub_param_layout,
)

# --------------------------------------------------------------------------------------------------------
# Generic and trainer-side builders
# --------------------------------------------------------------------------------------------------------


def test_a_replicated_map_lists_every_rank_as_holder() -> None:
    logical = arange((3, 4))
    tmap = replicated_map("w", (3, 4), "bfloat16", (5, 1, 3))
    check_storages(tmap, logical, {5: logical, 1: logical, 3: logical})
    assert {p.holders for s in tmap.ranks.values() for p in s.pieces} == {(1, 3, 5)}


def test_an_uneven_split_gives_each_rank_its_own_block() -> None:
    logical = arange((4, 7))
    tmap = split_map("w", (4, 7), "bfloat16", 1, (3, 0, 4), (0, 1, 2))
    check_storages(tmap, logical, {0: logical[:, 0:3], 1: logical[:, 3:3], 2: logical[:, 3:7]})
    assert tmap.ranks[1].shape == (4, 0)
    assert tmap.ranks[1].pieces == ()


def test_split_sizes_that_do_not_tile_the_dim_are_refused() -> None:
    with pytest.raises(LayoutError):
        split_map("w", (4, 7), "bfloat16", 1, (3, 3), (0, 1))


def test_zero3_partitions_start_mid_row_and_exclude_padding() -> None:
    logical = arange((5, 7))
    tmap = zero3_map("w", (5, 7), "bfloat16", (0, 1, 2, 3))
    check_storages(tmap, logical, dict(enumerate(zero3_parts(logical.ravel(), 4))))
    assert [tmap.ranks[r].shape for r in range(4)] == [(9,), (9,), (9,), (8,)]
    assert tmap.ranks[1].pieces[0].box.origin == (1, 2)


def test_a_zero3_rank_whose_partition_is_all_padding_holds_an_empty_storage() -> None:
    tmap = zero3_map("b", (5,), "bfloat16", (0, 1, 2, 3))  # 2, 2, 1, then nothing
    assert tmap.ranks[3].shape == (0,)
    assert tmap.ranks[3].pieces == ()
    check_tiling(tmap)


def test_zero3_alignment_rounds_the_partition_up() -> None:
    assert zero3_partition_numel(35, 4) == 9
    assert zero3_partition_numel(35, 4, alignment=4) == 12
    logical = arange((5, 7))
    tmap = zero3_map("w", (5, 7), "bfloat16", (0, 1, 2, 3), alignment=4)
    check_storages(tmap, logical, dict(enumerate(zero3_parts(logical.ravel(), 4, alignment=4))))
    assert [tmap.ranks[r].shape for r in range(4)] == [(12,), (12,), (11,), (0,)]


def test_zero3_runs_of_a_part_of_a_bigger_parameter() -> None:
    # expert 1's up_proj inside fused gate_up_proj [2, 2*3, 4], ZeRO-3 over 5 ranks
    fused = np.arange(2 * 6 * 4).reshape(2, 6, 4)
    runs = zero3_runs((0, 1, 2, 3, 4), 12, param_numel=48, base=36)
    parts = zero3_parts(fused.ravel(), 5)  # 10 per rank
    for k, run in enumerate(runs.runs):
        lo = max(36, k * 10)
        hi = min(48, (k + 1) * 10)
        got = parts[k][max(0, lo - k * 10) : max(0, hi - k * 10)]
        want = fused[1, 3:6].ravel()[run.start : run.stop]
        np.testing.assert_array_equal(got, want)
        assert run.stop - run.start == max(0, hi - lo)


def test_zero_0_1_2_replicas_list_every_dp_rank() -> None:
    logical = arange((2, 3))
    tmap = zero_replica_map("w", (2, 3), "float32", (0, 2, 4, 6))
    check_storages(tmap, logical, {r: logical for r in (0, 2, 4, 6)})
    assert tmap.ranks[4].pieces[0].holders == (0, 2, 4, 6)


def _rank_table(dp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(d * tp + t for d in range(dp)) for t in range(tp))


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_autotp_rows_under_zero_match_numpy(zero_stage: int) -> None:
    shape = (10, 6)
    sizes = (6, 4)
    table = _rank_table(3, 2)
    tmap = tp_zero_map(split_layout("q", shape, 0, sizes), "bfloat16", zero_stage, table)
    logical = arange(shape)
    shards = np.split(logical, [sizes[0]], axis=0)
    real = {}
    for t, shard in enumerate(shards):
        parts = zero3_parts(shard.ravel(), 3) if zero_stage == 3 else [shard] * 3
        for d in range(3):
            real[table[t][d]] = parts[d]
    check_storages(tmap, logical, real)


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    tp=st.integers(1, 4),
    dp=st.integers(1, 4),
    row_parallel=st.booleans(),
    zero_stage=st.sampled_from([2, 3]),
)
def test_random_autotp_times_zero_layouts_match_numpy(
    rows: int, cols: int, tp: int, dp: int, row_parallel: bool, zero_stage: int
) -> None:
    shape = (rows, cols)
    dim = 1 if row_parallel else 0
    sizes = even_sizes(shape[dim], tp)
    table = _rank_table(dp, tp)
    tmap = tp_zero_map(split_layout("w", shape, dim, sizes), "bfloat16", zero_stage, table)
    logical = arange(shape)
    bounds = np.cumsum(sizes)[:-1]
    real = {}
    for t, shard in enumerate(np.split(logical, bounds, axis=dim)):
        parts = zero3_parts(np.ascontiguousarray(shard).ravel(), dp) if zero_stage == 3 else [shard] * dp
        for d in range(dp):
            real[table[t][d]] = parts[d]
    check_storages(tmap, logical, real)


def test_a_replicated_tensor_under_autotp_and_zero3_is_held_by_one_rank_per_tp_group() -> None:
    table = _rank_table(2, 2)
    tmap = tp_zero_map(replicated_layout("norm", (9,), 2), "bfloat16", 3, table)
    logical = arange((9,))
    parts = zero3_parts(logical, 2)
    check_storages(tmap, logical, {0: parts[0], 1: parts[0], 2: parts[1], 3: parts[1]})
    assert tmap.ranks[2].pieces[0].holders == (2, 3)


def test_autotp_splits_attention_by_kv_head_groups_and_mlp_near_evenly() -> None:
    assert autotp_shard_sizes(4096, 2, "model.layers.0.self_attn.q_proj", 8) == (2048, 2048)
    assert autotp_shard_sizes(4096, 3, "model.layers.0.self_attn.q_proj", 8) == (1536, 1536, 1024)
    assert autotp_shard_sizes(12288, 5, "model.layers.0.mlp.gate_proj", 8) == (2458, 2458, 2458, 2457, 2457)
    assert autotp_shard_sizes(1000, 3, "lm_head", 8) == (334, 333, 333)
    assert autotp_shard_sizes(100, 3, "model.layers.0.mlp.up_proj", None, grain=64) == (64, 0, 36)


# --------------------------------------------------------------------------------------------------------
# vLLM targets: storages built the way vLLM lays out its parameters
# --------------------------------------------------------------------------------------------------------


def _engines(n: int, tp: int, first: int = 0) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(first + k * tp + w for w in range(tp)) for k in range(n))


def _qkv_param(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, kv: int, hd: int, tp: int, r: int):
    """vLLM's QKVParallelLinear weight on TP rank r, and the row offsets of its q, k, v parts."""
    qh = heads // tp
    if tp >= kv:
        kvh, head0 = 1, r // (tp // kv)
    else:
        kvh, head0 = kv // tp, r * (kv // tp)
    qs = q[r * qh * hd : (r + 1) * qh * hd]
    ks = k[head0 * hd : (head0 + kvh) * hd]
    vs = v[head0 * hd : (head0 + kvh) * hd]
    return np.concatenate([qs, ks, vs]), (0, len(qs), len(qs) + len(ks), len(qs) + 2 * len(ks))


@pytest.mark.parametrize(("tp", "kv"), [(1, 2), (2, 2), (4, 2), (8, 2), (2, 4), (4, 1)])
def test_fused_qkv_parts_match_vllm_rows_with_kv_heads_replicated(tp: int, kv: int) -> None:
    heads, hd, hidden = 8, 3, 5
    q, k, v = arange((heads * hd, hidden)), arange((kv * hd, hidden)), arange((kv * hd, hidden))
    engines = _engines(2, tp, first=10)
    maps = {
        part: vllm_qkv_part_map(f"{part}_proj.weight", t.shape, "bfloat16", part, heads, kv, hd, engines)
        for part, t in (("q", q), ("k", k), ("v", v))
    }
    for i, (part, logical) in enumerate((("q", q), ("k", k), ("v", v))):
        real = {}
        for workers in engines:
            for r, rank in enumerate(workers):
                param, offsets = _qkv_param(q, k, v, heads, kv, hd, tp, r)
                real[rank] = param[offsets[i] : offsets[i + 1]]  # the row-range view of qkv_proj.weight
        check_storages(maps[part], logical, real)
    holders = {p.holders for p in maps["k"].ranks[10].pieces}
    replicas = max(1, tp // kv)
    assert holders == {tuple(sorted(w[r] for w in engines for r in range(replicas)))}


def test_gate_up_parts_are_the_row_halves_of_gate_up_proj() -> None:
    inter, hidden, tp = 8, 3, 4
    gate, up = arange((inter, hidden)), arange((inter, hidden)) + 1000
    engines = _engines(1, tp)
    gmap = vllm_gate_up_part_map("gate", gate.shape, "bfloat16", engines)
    umap = vllm_gate_up_part_map("up", up.shape, "bfloat16", engines)
    n = inter // tp
    params = {r: np.concatenate([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]]) for r in range(tp)}
    check_storages(gmap, gate, {r: params[r][:n] for r in range(tp)})
    check_storages(umap, up, {r: params[r][n:] for r in range(tp)})


def test_row_and_column_parallel_linears() -> None:
    logical = arange((4, 6))
    engines = _engines(1, 2)
    check_storages(
        vllm_column_map("c", (4, 6), "bfloat16", engines), logical, {0: logical[:2], 1: logical[2:]}
    )
    check_storages(
        vllm_row_map("r", (4, 6), "bfloat16", engines), logical, {0: logical[:, :3], 1: logical[:, 3:]}
    )
    with pytest.raises(LayoutError):
        vllm_row_map("r", (4, 5), "bfloat16", engines)


@pytest.mark.parametrize(("vocab", "tp"), [(1000, 1), (1000, 2), (1000, 4), (130, 4), (64, 2), (100, 8)])
def test_vocab_shards_exclude_the_padding_rows(vocab: int, tp: int) -> None:
    hidden = 3
    logical = arange((vocab, hidden))
    padded = -(-vocab // 64) * 64
    per = padded // tp
    full = np.concatenate([logical, np.full((padded - vocab, hidden), -1)])
    tmap = vllm_vocab_map("embed", (vocab, hidden), "bfloat16", _engines(1, tp))
    real = {}
    for r in range(tp):
        param = full[r * per : (r + 1) * per]
        real[r] = param[: int((param[:, 0] >= 0).sum())]  # weight[0 : n_real]
    check_storages(tmap, logical, real)
    assert [stop - start for start, stop in vllm_vocab_rows(vocab, tp)] == [len(real[r]) for r in range(tp)]


def test_an_all_padding_vocab_shard_is_empty() -> None:
    tmap = vllm_vocab_map("embed", (100, 3), "bfloat16", _engines(1, 8))  # padded 128, 16 per rank
    assert tmap.ranks[7].shape == (0, 3)
    assert tmap.ranks[7].pieces == ()


def test_replicated_targets_span_engines() -> None:
    logical = arange((5,))
    tmap = vllm_replicated_map("norm", (5,), "bfloat16", _engines(2, 2, first=4))
    check_storages(tmap, logical, {r: logical for r in (4, 5, 6, 7)})
    assert tmap.ranks[4].pieces[0].holders == (4, 5, 6, 7)


def test_experts_under_tp_are_split_along_the_intermediate_dim() -> None:
    experts, inter, hidden, tp = 3, 4, 5, 2
    gate = [arange((inter, hidden)) + 100 * e for e in range(experts)]
    up = [arange((inter, hidden)) + 100 * e + 50 for e in range(experts)]
    down = [arange((hidden, inter)) + 100 * e for e in range(experts)]
    n = inter // tp
    w13 = {
        r: np.stack(
            [
                np.concatenate([gate[e][r * n : (r + 1) * n], up[e][r * n : (r + 1) * n]])
                for e in range(experts)
            ]
        )
        for r in range(tp)
    }
    w2 = {r: np.stack([down[e][:, r * n : (r + 1) * n] for e in range(experts)]) for r in range(tp)}
    engines = _engines(1, tp)
    for e in range(experts):
        g = vllm_expert_map("g", gate[e].shape, "bfloat16", "gate", e, experts, engines)
        u = vllm_expert_map("u", up[e].shape, "bfloat16", "up", e, experts, engines)
        d = vllm_expert_map("d", down[e].shape, "bfloat16", "down", e, experts, engines)
        check_storages(g, gate[e], {r: w13[r][e, :n] for r in range(tp)})
        check_storages(u, up[e], {r: w13[r][e, n:] for r in range(tp)})
        check_storages(d, down[e], {r: w2[r][e] for r in range(tp)})


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_experts_under_ep_live_whole_on_their_owner(placement: str) -> None:
    experts, inter, hidden, ep = 7, 2, 3, 3
    gate = [arange((inter, hidden)) + 100 * e for e in range(experts)]
    engines = _engines(2, ep, first=2)
    owners = [vllm_expert_owner(e, experts, ep, placement) for e in range(experts)]
    local = {r: [e for e in range(experts) if owners[e][0] == r] for r in range(ep)}
    for r in range(ep):
        assert [owners[e][1] for e in local[r]] == list(range(len(local[r])))
    for e in range(experts):
        tmap = vllm_expert_map("g", (inter, hidden), "bfloat16", "gate", e, experts, engines, True, placement)
        owner = owners[e][0]
        check_storages(tmap, gate[e], {w[owner]: gate[e] for w in engines})
        assert tmap.ranks[engines[0][owner]].pieces[0].holders == (engines[0][owner], engines[1][owner])


def test_linear_expert_placement_gives_the_first_ranks_one_more() -> None:
    assert [vllm_expert_owner(e, 8, 3)[0] for e in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert [vllm_expert_owner(e, 8, 3, "round_robin")[0] for e in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]


def test_engines_of_unequal_size_are_refused() -> None:
    with pytest.raises(LayoutError):
        vllm_column_map("c", (4, 2), "bfloat16", ((0, 1), (2,)))


def test_every_builder_map_has_the_numel_of_its_tensor_on_each_side() -> None:
    tmap = vllm_qkv_part_map("k", (2 * 4, 3), "bfloat16", "k", 8, 2, 4, _engines(1, 8))
    distinct = {p.box for s in tmap.ranks.values() for p in s.pieces}
    assert sum(prod(b.extent) for b in distinct) == 2 * 4 * 3


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fused_sub_parameter_shards_under_zero_match_numpy(data: st.DataObject) -> None:
    """A fused parameter (q|k|v rows, or gate|up) split per sub-parameter over TP ranks (DeepSpeed's
    sub_param_map), each rank's stacked shard stored whole (ZeRO-2) or ZeRO-3 partitioned."""
    subs = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    cols = data.draw(st.integers(1, 5))
    tp = data.draw(st.integers(1, 3))
    dp = data.draw(st.integers(1, 3))
    zero_stage = data.draw(st.sampled_from([2, 3]))
    widths = [even_sizes(n, tp) for n in subs]
    shape = (sum(subs), cols)
    logical = arange(shape)
    table = _rank_table(dp, tp)
    tmap = tp_zero_map(sub_param_layout("fused", shape, 0, subs, widths), "bfloat16", zero_stage, table)
    real = {}
    starts = np.cumsum([0, *subs])
    for t in range(tp):
        rows = []
        for i, sub in enumerate(np.split(logical, starts[1:-1], axis=0)):
            lo = sum(widths[i][:t])
            rows.append(sub[lo : lo + widths[i][t]])
        shard = np.concatenate(rows)
        parts = zero3_parts(shard.ravel(), dp) if zero_stage == 3 else [shard] * dp
        for d in range(dp):
            real[table[t][d]] = parts[d]
    check_storages(tmap, logical, real)
