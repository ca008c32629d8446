"""The pure parts of setup's fast path: maps and storage views from shapes (``shape_targets``,
``vllm_param_views``) and their check against loader traces (``check.check_targets``), with synthetic
traces standing for what vLLM's loaders do. The real loaders are traced in tests/vllm/test_fast_targets.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rollout_sync.errors import TargetMismatchError, UnsupportedLayoutError
from rollout_sync.geometry.model_maps import vllm_target_maps
from rollout_sync.layout.box import row_major_strides
from rollout_sync.rollout.check import LoaderTrace, TracedCopy, check_targets, target_differences
from rollout_sync.rollout.shape_targets import shape_targets, vllm_param_views
from rollout_sync.shapes import model_tensors

CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 2,
    "vocab_size": 100,
    "intermediate_size": 6,
    "tie_word_embeddings": False,
}
MOE = {**CONFIG, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 4}


def _shapes(config):
    return {t.name: t.shape for t in model_tensors(config).tensors}


def _params(targets, dtype="bfloat16"):
    return {v.param: dtype for v in targets.views.values()}


def _storage_shapes(model, tp, tp_rank, ep):
    """Storage shapes on worker ``tp_rank`` of an engine whose first worker is global rank 10."""
    return {
        m.name: m.ranks[10 + tp_rank].shape
        for m in vllm_target_maps(model, 1, tp, ep, 10)
        if 10 + tp_rank in m.ranks
    }


def _targets(config, tp, tp_rank, ep=1):
    """The fast targets of worker ``tp_rank``, every parameter the views name present (bf16)."""
    model = model_tensors(config)
    views = vllm_param_views(model, _storage_shapes(model, tp, tp_rank, ep), tp=tp, ep=ep)
    params = dict.fromkeys((p for p, _ in views.values()), "bfloat16")
    return shape_targets(model, _shapes(config), params, rank=10 + tp_rank, tp_rank=tp_rank, tp=tp, ep=ep)


def _faithful_traces(targets, shapes):
    """What a loader that does exactly what the maps say would be traced doing: one copy per piece."""
    traces = {}
    for name, shape in shapes.items():
        if name in targets.absent:
            traces[name] = LoaderTrace(name, ())
            continue
        view = targets.views[name]
        storage = targets.maps[name].ranks[targets.rank]
        logical = row_major_strides(tuple(shape))
        copies = []
        for p in storage.pieces:
            origin = sum(o * s for o, s in zip(p.box.origin, logical, strict=True))
            copies.append(
                TracedCopy(view.param, p.box.extent, view.offset + p.offset, p.strides, origin, logical)
            )
        traces[name] = LoaderTrace(name, tuple(copies))
    return traces


def test_param_views_follow_vllms_fused_layouts():
    model = model_tensors(CONFIG)
    shapes = _storage_shapes(model, 2, 1, 1)
    views = vllm_param_views(model, shapes, tp=2)
    a = "model.layers.0.self_attn"
    # TP 2: q holds 2 heads x 2 rows, k and v one kv head x 2 rows each, of 8 columns
    assert views[f"{a}.q_proj.weight"] == (f"{a}.qkv_proj.weight", 0)
    assert views[f"{a}.k_proj.weight"] == (f"{a}.qkv_proj.weight", 4 * 8)
    assert views[f"{a}.v_proj.weight"] == (f"{a}.qkv_proj.weight", 6 * 8)
    assert views["model.layers.0.mlp.up_proj.weight"] == ("model.layers.0.mlp.gate_up_proj.weight", 3 * 8)
    assert views["model.embed_tokens.weight"] == ("model.embed_tokens.weight", 0)


def test_param_views_place_experts_by_local_index():
    model = model_tensors(MOE)
    shapes = _storage_shapes(model, 2, 1, 2)
    views = vllm_param_views(model, shapes, tp=2, ep=2)
    e = "model.layers.0.mlp.experts"
    # EP 2, linear placement: rank 1 holds experts 2 and 3 at local indices 0 and 1; gate/up [4, 8] each
    assert f"{e}.0.gate_proj.weight" not in views
    assert views[f"{e}.3.gate_proj.weight"] == (f"{e}.routed_experts.w13_weight", 1 * 2 * 32)
    assert views[f"{e}.3.up_proj.weight"] == (f"{e}.routed_experts.w13_weight", 1 * 2 * 32 + 32)
    assert views[f"{e}.3.down_proj.weight"] == (f"{e}.routed_experts.w2_weight", 32)


def test_unknown_model_types_and_tensors_are_refused_for_the_fast_path():
    with pytest.raises(UnsupportedLayoutError, match="no vLLM parameter arithmetic"):
        vllm_param_views(replace(model_tensors(CONFIG), model_type="llama"), {}, tp=1)
    shapes = {**_shapes(CONFIG), "model.extra.weight": (3,)}
    with pytest.raises(UnsupportedLayoutError, match="shape table does not describe"):
        shape_targets(model_tensors(CONFIG), shapes, {}, rank=0, tp_rank=0, tp=1)
    with pytest.raises(UnsupportedLayoutError, match="no parameter where the shape table puts"):
        shape_targets(model_tensors(CONFIG), _shapes(CONFIG), {}, rank=0, tp_rank=0, tp=1)


@pytest.mark.parametrize(
    ("config", "tp", "tp_rank", "ep"), [(CONFIG, 1, 0, 1), (CONFIG, 2, 1, 1), (MOE, 2, 0, 1), (MOE, 2, 1, 2)]
)
def test_faithful_traces_confirm_every_tensor(config, tp, tp_rank, ep):
    targets = _targets(config, tp, tp_rank, ep)
    shapes = _shapes(config)
    assert check_targets(targets, shapes, _faithful_traces(targets, shapes)) == []


def test_a_copy_one_row_off_is_named_with_its_first_wrong_position():
    targets = _targets(CONFIG, 2, 1)
    shapes = _shapes(CONFIG)
    traces = _faithful_traces(targets, shapes)
    name = "model.embed_tokens.weight"  # rank 1 holds rows [64, 100) at rows [0, 36) of its shard
    (copy,) = traces[name].copies
    shifted = TracedCopy(
        copy.param, copy.shape, copy.offset + 8, copy.strides, copy.source_offset, copy.source_strides
    )
    traces[name] = LoaderTrace(name, (shifted,))
    with pytest.raises(TargetMismatchError) as err:
        check_targets(targets, shapes, traces)
    assert err.value.tensor == name and err.value.rank == 11
    assert "first wrong position [64, 0]" in str(err.value)


def test_a_transposed_copy_is_caught_at_the_first_step_along_an_axis():
    targets = _targets(CONFIG, 1, 0)
    shapes = _shapes(CONFIG)
    traces = _faithful_traces(targets, shapes)
    name = "model.layers.0.self_attn.o_proj.weight"  # [8, 8]
    (copy,) = traces[name].copies
    traces[name] = LoaderTrace(
        name,
        (TracedCopy(copy.param, copy.shape, copy.offset, (1, 8), copy.source_offset, copy.source_strides),),
    )
    with pytest.raises(TargetMismatchError, match=r"first wrong position \[0, 1\]"):
        check_targets(targets, shapes, traces)


def test_elements_the_loader_leaves_out_or_adds_are_refused():
    targets = _targets(CONFIG, 2, 0)
    shapes = _shapes(CONFIG)
    name = "model.layers.0.mlp.down_proj.weight"  # [8, 6], rank 0 holds columns [0, 3)
    traces = _faithful_traces(targets, shapes)
    (copy,) = traces[name].copies
    half = TracedCopy(copy.param, (4, 3), copy.offset, copy.strides, copy.source_offset, copy.source_strides)
    traces[name] = LoaderTrace(name, (half,))
    with pytest.raises(TargetMismatchError, match=r"does not write here; first wrong position \[4, 0\]"):
        check_targets(targets, shapes, traces)
    # the loader also writes column 3 (rank 1's), after the maps' three columns of each row
    traces[name] = LoaderTrace(
        name, (copy, TracedCopy("elsewhere", (1, 1), 0, (1, 1), 3, copy.source_strides))
    )
    with pytest.raises(
        TargetMismatchError, match=r"do not place on this worker; first wrong position \[0, 3\]"
    ):
        check_targets(targets, shapes, traces)
    # an expert the maps place on the other EP rank, written here
    moe = _targets(MOE, 2, 1, ep=2)
    moe_shapes = _shapes(MOE)
    moe_traces = _faithful_traces(moe, moe_shapes)
    gone = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert gone in moe.absent
    moe_traces[gone] = LoaderTrace(gone, (TracedCopy("p", (4, 8), 0, (8, 1), 0, (8, 1)),))
    with pytest.raises(TargetMismatchError, match="place none of it here"):
        check_targets(moe, moe_shapes, moe_traces)


def test_untraceable_loaders_are_handed_back_for_the_element_probe():
    targets = _targets(CONFIG, 1, 0)
    shapes = _shapes(CONFIG)
    traces = _faithful_traces(targets, shapes)
    traces["model.norm.weight"] = LoaderTrace("model.norm.weight", (), "_Transformed: mul")
    flipped = "model.layers.0.self_attn.o_proj.weight"
    (copy,) = traces[flipped].copies
    traces[flipped] = LoaderTrace(
        flipped, (TracedCopy(copy.param, copy.shape, copy.offset, copy.strides, 0, (2, 1)),)
    )
    del traces["lm_head.weight"]
    unconfirmed = check_targets(targets, shapes, traces)
    assert unconfirmed == [n for n in shapes if n in (flipped, "model.norm.weight", "lm_head.weight")]


def test_target_differences_ignore_representation_and_name_real_differences():
    a = _targets(CONFIG, 2, 0)
    assert target_differences(a, a) == []
    b = _targets(CONFIG, 2, 1)
    assert any("rank" in d for d in target_differences(a, b))
    c = _targets(CONFIG, 2, 0)
    moved = {**c.views, "model.norm.weight": replace(c.views["model.norm.weight"], offset=1)}
    assert target_differences(a, replace(c, views=moved)) == [
        f"model.norm.weight: storage views differ ({a.views['model.norm.weight']} against {moved['model.norm.weight']})"
    ]
