"""Model shape tables (names and shapes as ``save_pretrained`` writes them) and whole-model maps per side."""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_nesting import arange, check_storages, check_tiling, zero3_parts

from rollout_sync.errors import LayoutError, UnsupportedLayoutError
from rollout_sync.geometry import trainer_maps, vllm_target_maps
from rollout_sync.geometry.deepspeed import tp_zero_map, trainer_rank_table
from rollout_sync.geometry.vllm import vllm_engine_ranks, vllm_qkv_part_map
from rollout_sync.layout.builders import split_layout
from rollout_sync.shapes import PRESETS, model_tensors, preset

TINY_QWEN3: dict[str, Any] = {
    "model_type": "qwen3",
    "num_hidden_layers": 2,
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
    "vocab_size": 100,
    "tie_word_embeddings": False,
}
TINY_QWEN3_MOE: dict[str, Any] = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 6,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
TINY_DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 3,
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 12,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
    "vocab_size": 100,
    "tie_word_embeddings": False,
}


# --------------------------------------------------------------------------------------------------------
# Shape tables
# --------------------------------------------------------------------------------------------------------


def _qwen3_dense_numel(
    layers: int, h: int, heads: int, kv: int, hd: int, inter: int, vocab: int, tied: bool
) -> int:
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd
    mlp = 3 * h * inter
    return vocab * h * (1 if tied else 2) + h + layers * (attn + mlp + 2 * h)


def test_qwen3_8b_has_the_published_shapes() -> None:
    m = preset("qwen3-8b")
    assert len(m.tensors) == 1 + 36 * 11 + 2
    assert m.numel == _qwen3_dense_numel(36, 4096, 32, 8, 128, 12288, 151936, False)
    shapes = {t.name: t.shape for t in m.tensors}
    assert shapes["model.layers.35.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["lm_head.weight"] == (151936, 4096)
    assert 8.1e9 < m.numel < 8.3e9


def test_tied_qwen3_has_no_lm_head() -> None:
    m = preset("qwen3-0.6b")
    names = [t.name for t in m.tensors]
    assert "lm_head.weight" not in names
    assert names[0] == "model.embed_tokens.weight"
    assert m.numel == _qwen3_dense_numel(28, 1024, 16, 8, 128, 3072, 151936, True)


def test_moe_presets_have_per_expert_keys_and_routers() -> None:
    m = preset("qwen3-30b-a3b")
    kinds = [t.kind for t in m.tensors]
    assert kinds.count("expert_gate") == 48 * 128
    names = {t.name: t for t in m.tensors}
    t = names["model.layers.47.mlp.experts.127.down_proj.weight"]
    assert (t.shape, t.kind, t.layer, t.expert) == ((2048, 768), "expert_down", 47, 127)
    assert names["model.layers.0.mlp.gate.weight"].shape == (128, 2048)
    assert 30e9 < m.numel < 31e9
    assert 234e9 < preset("qwen3-235b-a22b").numel < 236e9


def test_deepseek_v3_and_kimi_k2_have_mla_dense_first_layers_and_shared_experts() -> None:
    ds = preset("deepseek-v3")
    names = {t.name: t for t in ds.tensors}
    assert "model.layers.2.mlp.gate_proj.weight" in names
    assert "model.layers.3.mlp.experts.255.up_proj.weight" in names
    assert names["model.layers.3.mlp.shared_experts.down_proj.weight"].shape == (7168, 2048)
    assert names["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert names["model.layers.0.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert names["model.layers.0.self_attn.kv_b_proj.weight"].shape == (128 * 256, 512)
    bias = names["model.layers.60.mlp.gate.e_score_correction_bias"]
    assert (bias.shape, bias.dtype, bias.buffer) == ((256,), "float32", True)
    assert sum(t.kind.startswith("expert_") for t in ds.tensors) == 58 * 256 * 3
    assert 670e9 < ds.numel < 672e9  # 671B main model (the MTP layer is not modelled)
    kimi = preset("kimi-k2")
    assert sum(t.kind.startswith("expert_") for t in kimi.tensors) == 60 * 384 * 3
    assert "model.layers.0.mlp.down_proj.weight" in {t.name for t in kimi.tensors}
    assert 1.0e12 < kimi.numel < 1.05e12


def test_every_preset_has_only_known_kinds_and_unique_names() -> None:
    for name in PRESETS:
        m = preset(name)
        assert len({t.name for t in m.tensors}) == len(m.tensors)
        assert all(t.kind for t in m.tensors)


def test_an_unknown_model_type_is_refused() -> None:
    with pytest.raises(LayoutError):
        model_tensors({"model_type": "llama"})


def _saved_keys(config: dict[str, Any], tmp_path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors")
    cfg = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "init")
    # A trainer loads a checkpoint (from_pretrained keeps e.g. DeepSeek's router bias in float32), then saves.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "init", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    out = {}
    for f in sorted((tmp_path / "saved").glob("*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = handle.get_slice(key)
                out[key] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    return out


@pytest.mark.parametrize(
    "config", [TINY_QWEN3, {**TINY_QWEN3, "tie_word_embeddings": True}, TINY_QWEN3_MOE, TINY_DEEPSEEK]
)
def test_names_and_shapes_are_what_save_pretrained_writes(config: dict[str, Any], tmp_path: Path) -> None:
    saved = _saved_keys(config, tmp_path)
    table = model_tensors(config)
    assert {t.name: t.shape for t in table.tensors} == {k: v[0] for k, v in saved.items()}
    for t in table.tensors:
        if t.dtype == "float32":
            assert saved[t.name][1] == "F32", t.name


# --------------------------------------------------------------------------------------------------------
# Whole-model maps
# --------------------------------------------------------------------------------------------------------


def test_trainer_ranks_are_dp_major_and_rollout_ranks_follow_engine_by_engine() -> None:
    assert trainer_rank_table(2, 4) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert vllm_engine_ranks(2, 2, 8) == ((8, 9), (10, 11))


@pytest.mark.parametrize(("zero_stage", "dp", "tp"), [(0, 2, 2), (2, 3, 1), (3, 2, 2), (3, 3, 2), (1, 1, 4)])
def test_trainer_maps_of_a_dense_model_tile_every_tensor_on_every_rank(
    zero_stage: int, dp: int, tp: int
) -> None:
    m = model_tensors(TINY_QWEN3)
    maps = trainer_maps(m, zero_stage, dp, tp)
    assert [x.name for x in maps] == [t.name for t in m.tensors]
    for x in maps:
        check_tiling(x)
        assert set(x.ranks) == set(range(dp * tp))


def test_maps_reused_across_layers_equal_maps_built_alone() -> None:
    m = model_tensors(TINY_QWEN3)
    maps = {x.name: x for x in trainer_maps(m, 3, 2, 2)}
    table = trainer_rank_table(2, 2)
    for layer in (0, 1):
        name = f"model.layers.{layer}.self_attn.o_proj.weight"
        alone = tp_zero_map(split_layout(name, (16, 32), 1, (16, 16)), "bfloat16", 3, table)
        assert maps[name] == alone
    targets = {x.name: x for x in vllm_target_maps(m, 2, 2, first_rank=4)}
    for layer in (0, 1):
        name = f"model.layers.{layer}.self_attn.k_proj.weight"
        alone = vllm_qkv_part_map(name, (16, 16), "bfloat16", "k", 4, 2, 8, vllm_engine_ranks(2, 2, 4))
        assert targets[name] == alone


@pytest.mark.parametrize(("engines", "tp", "ep"), [(1, 1, 1), (2, 2, 1), (1, 4, 1), (1, 2, 2), (2, 4, 4)])
@pytest.mark.parametrize("config", [TINY_QWEN3, TINY_QWEN3_MOE, TINY_DEEPSEEK])
def test_vllm_target_maps_tile_every_tensor(config: dict[str, Any], engines: int, tp: int, ep: int) -> None:
    m = model_tensors(config)
    if (
        tp > m.num_heads
        or (m.num_heads % tp)
        or (m.moe_intermediate_size and ep == 1 and m.moe_intermediate_size % tp)
    ):
        pytest.skip("shape not divisible by this TP size")
    maps = vllm_target_maps(m, engines, tp, ep, first_rank=3)
    workers = {3 + i for i in range(engines * tp)}
    for x, t in zip(maps, [t for t in m.tensors if t.in_vllm], strict=True):
        assert x.name == t.name
        check_tiling(x)
        if t.kind.startswith("expert_") and ep > 1:
            assert len(x.ranks) == engines
        else:
            assert set(x.ranks) == workers


def test_trainer_zero3_experts_are_runs_of_the_fused_parameters() -> None:
    m = model_tensors(TINY_QWEN3_MOE)
    dp = 3
    maps = {x.name: x for x in trainer_maps(m, 3, dp, 1)}
    e_count, inter, hidden = 4, 6, 16
    gate = [arange((inter, hidden)) + 1000 * e for e in range(e_count)]
    up = [arange((inter, hidden)) + 1000 * e + 500 for e in range(e_count)]
    down = [arange((hidden, inter)) + 1000 * e for e in range(e_count)]
    gate_up = np.stack([np.concatenate([gate[e], up[e]]) for e in range(e_count)])  # HF [E, 2I, H]
    down_proj = np.stack(down)  # HF [E, H, I]
    for fused, part, logical_of, base_of in (
        (gate_up, "gate_proj", gate, lambda e: e * 2 * inter * hidden),
        (gate_up, "up_proj", up, lambda e: e * 2 * inter * hidden + inter * hidden),
        (down_proj, "down_proj", down, lambda e: e * inter * hidden),
    ):
        parts = zero3_parts(fused.ravel(), dp)
        p = len(parts[0])
        n = inter * hidden
        for e in range(e_count):
            base = base_of(e)
            real = {k: parts[k][max(0, base - k * p) : max(0, min(p, base + n - k * p))] for k in range(dp)}
            check_storages(maps[f"model.layers.1.mlp.experts.{e}.{part}.weight"], logical_of[e], real)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_trainer_autoep_experts_live_on_their_ep_rank_and_its_expert_dp_group(zero_stage: int) -> None:
    m = model_tensors(TINY_QWEN3_MOE)
    dp, ep = 4, 2
    maps = {x.name: x for x in trainer_maps(m, zero_stage, dp, 1, ep)}
    local, inter, hidden = 2, 6, 16
    down = [arange((hidden, inter)) + 1000 * e for e in range(4)]
    for k in range(ep):
        w2 = np.stack(down[k * local : (k + 1) * local])  # AutoEP packed [local, H, I] on EP rank k
        edp = [r for r in range(dp) if r % ep == k]
        parts = zero3_parts(w2.ravel(), len(edp)) if zero_stage == 3 else None
        for idx in range(local):
            e = k * local + idx
            if parts is None:
                real = {r: w2[idx] for r in edp}
            else:
                p, n = len(parts[0]), hidden * inter
                real = {
                    r: parts[j][max(0, idx * n - j * p) : max(0, min(p, (idx + 1) * n - j * p))]
                    for j, r in enumerate(edp)
                }
            check_storages(maps[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down[e], real)


def test_deepseek_router_bias_is_a_float32_buffer_on_every_trainer_rank() -> None:
    m = model_tensors(TINY_DEEPSEEK)
    maps = {x.name: x for x in trainer_maps(m, 3, 4, 1)}
    bias = maps["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == "float32"
    assert set(bias.ranks) == {0, 1, 2, 3}
    assert all(s.shape == (4,) for s in bias.ranks.values())


@pytest.mark.parametrize(("topk_method", "in_vllm"), [("noaux_tc", True), (None, False), ("greedy", False)])
def test_vllm_holds_the_router_bias_only_for_noaux_tc_routing(topk_method: str | None, in_vllm: bool) -> None:
    config = dict(TINY_DEEPSEEK)
    if topk_method is not None:
        config["topk_method"] = topk_method
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    targets = {x.name: x for x in vllm_target_maps(model_tensors(config), 1, 2, first_rank=4)}
    assert (name in targets) is in_vllm
    if in_vllm:
        assert targets[name].dtype == "float32"
        assert set(targets[name].ranks) == {4, 5}


def test_autotp_with_moe_experts_and_ep_outside_an_engine_are_refused() -> None:
    m = model_tensors(TINY_QWEN3_MOE)
    with pytest.raises(UnsupportedLayoutError):
        trainer_maps(m, 2, 2, 2)
    with pytest.raises(UnsupportedLayoutError):
        vllm_target_maps(m, 1, 4, 2)
    with pytest.raises(LayoutError):
        trainer_maps(m, 2, 3, 1, ep=2)


def test_a_large_moe_dry_run_builds_every_map() -> None:
    m = preset("kimi-k2")
    maps = vllm_target_maps(m, engines=2, tp=8, ep=8, first_rank=64)
    assert len(maps) == len(m.tensors)
    expert = {x.name: x for x in maps[-3000:]}["model.layers.60.mlp.experts.383.down_proj.weight"]
    assert sorted(expert.ranks) == [64 + 7, 64 + 15]
    assert prod(expert.ranks[71].shape) == 7168 * 2048


def test_autotp_layout_of_mla_projections_is_refused_not_guessed() -> None:
    from rollout_sync.geometry.deepspeed import autotp_shape_layout

    m = model_tensors(TINY_DEEPSEEK)
    q_b = m.by_name()["model.layers.0.self_attn.q_b_proj.weight"]
    with pytest.raises(UnsupportedLayoutError):
        autotp_shape_layout(q_b, 2, m.num_kv_heads)
    shared = m.by_name()["model.layers.1.mlp.shared_experts.down_proj.weight"]
    assert sorted(autotp_shape_layout(shared, 2, m.num_kv_heads).shards) == [0, 1]
