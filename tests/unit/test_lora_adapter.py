"""LoRA adapters, pure logic: which trainer parameters are a PEFT adapter and under which names
(``trainer.adapter``), what vLLM cannot serve (refused, typed), and where each worker stores A and B in its
slot (``rollout.lora_slots``): the target maps plan against the trainer's maps and every element lands once,
in the slot or in B's staging tensor."""

from __future__ import annotations

import math

import pytest
from test_planner_oracle import run_and_check

from rollout_sync.errors import UnsupportedLayoutError
from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.combine import merge
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.planning.planner import plan_model
from rollout_sync.rollout.lora_maps import LoraSlice, slice_targets, slot_a_name, staged_name
from rollout_sync.trainer.adapter import adapter_config, adapter_maps, adapter_tensor_name

LORA = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}


def test_peft_parameter_names_become_the_saved_adapter_names_and_base_weights_are_left_out():
    name = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight"
    assert adapter_tensor_name(name) == "model.layers.3.self_attn.q_proj.lora_A.weight"
    assert (
        adapter_tensor_name(name.replace("lora_A", "lora_B"))
        == "model.layers.3.self_attn.q_proj.lora_B.weight"
    )
    assert adapter_tensor_name("base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight") is None
    assert adapter_tensor_name(name, adapter="other") is None


def test_adapter_maps_rename_and_keep_only_the_adapter():
    shape = (8, 64)
    maps = [
        TensorMap(n, shape, "bfloat16", {0: _whole(shape, 0)})
        for n in (
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight",
            "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight",
        )
    ]
    got = adapter_maps(maps)
    assert [m.name for m in got] == ["model.layers.0.mlp.up_proj.lora_A.weight"]
    with pytest.raises(UnsupportedLayoutError, match="without LoRA parameters"):
        adapter_maps(maps[1:])


def test_scaling_is_what_vllm_folds_into_b_alpha_over_r_or_over_sqrt_r_with_rslora():
    assert adapter_config({"default": LORA}).scaling == 2.0
    rs = adapter_config({"default": {**LORA, "use_rslora": True}})
    assert rs.scaling == 16 / math.sqrt(8)
    assert adapter_config({"default": {**LORA, "target_modules": "all-linear"}}).target_modules is None


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"peft_type": "IA3"}, "IA3 adapter"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules to save"),
        ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
    ],
)
def test_what_vllm_cannot_serve_is_refused_by_name(change, what):
    with pytest.raises(UnsupportedLayoutError, match=what):
        adapter_config({"default": {**LORA, **change}})


def test_several_adapters_are_refused():
    with pytest.raises(UnsupportedLayoutError, match="several adapters"):
        adapter_config({"a": LORA, "b": LORA})


def _whole(shape: tuple[int, ...], rank: int) -> RankStorage:
    box = Box((0,) * len(shape), shape)
    return RankStorage(shape, (Piece(box, 0, row_major_strides(shape), (rank,)),))


def _qkv_slices(tp_rank: int, tp: int, r: int, max_rank: int) -> list[LoraSlice]:
    """A packed qkv layer as vLLM's MergedQKVParallelLinearWithLoRA slices it: A whole, B's rows by TP."""
    hidden, outs = 64, (128, 64, 64)
    out = []
    for i, (module, rows) in enumerate(zip(("q_proj", "k_proj", "v_proj"), outs, strict=True)):
        local = rows // tp
        out.append(
            LoraSlice(
                f"model.layers.0.self_attn.{module}",
                "model.layers.0.self_attn.qkv_proj",
                i,
                (r, hidden),
                (rows, r),
                Box((0, 0), (r, hidden)),
                Box((tp_rank * local, 0), (local, r)),
                (2, 1, max_rank, hidden),
                (2, 1, local, max_rank),
            )
        )
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_slot_targets_plan_against_the_trainer_maps_and_land_every_element_once(tp):
    r, max_rank, slot = 4, 8, 1
    trainer = {}
    locals_ = []
    for tp_rank in range(tp):
        targets, staged = slice_targets(
            _qkv_slices(tp_rank, tp, r, max_rank), rank=2 + tp_rank, slot=slot, dtype="bfloat16", scaling=2.0
        )
        locals_.append(targets)
        for name, m in targets.maps.items():
            trainer.setdefault(name, m.shape)
        # A fills whole rows of its slot: in place, at the slot's offset; B is staged and scaled
        a = targets.views["model.layers.0.self_attn.k_proj.lora_A.weight"]
        assert a.param == slot_a_name("model.layers.0.self_attn.qkv_proj", 1)
        assert (a.offset, a.shape) == (slot * max_rank * 64, (r, 64))
        b = targets.views["model.layers.0.self_attn.k_proj.lora_B.weight"]
        assert b.param == staged_name("model.layers.0.self_attn.qkv_proj", "b", 1)
        assert [s.scaling for s in staged] == [2.0, 2.0, 2.0]
    sources = [TensorMap(n, s, "bfloat16", {0: _whole(s, 0)}) for n, s in trainer.items()]
    by_name: dict[str, list[TensorMap]] = {}
    for t in locals_:
        for name, m in t.maps.items():
            by_name.setdefault(name, []).append(m)
    targets = [merge(ms) for ms in by_name.values()]
    run_and_check(plan_model(sources, targets), sources, targets)


def test_a_box_wider_than_the_slot_is_refused_naming_max_lora_rank():
    slices = _qkv_slices(0, 1, r=16, max_rank=8)
    with pytest.raises(UnsupportedLayoutError, match="max_lora_rank"):
        slice_targets(slices, rank=0, slot=0, dtype="bfloat16", scaling=1.0)
    with pytest.raises(UnsupportedLayoutError, match="no such LoRA slot"):
        slice_targets(_qkv_slices(0, 1, r=4, max_rank=8), rank=0, slot=2, dtype="bfloat16", scaling=1.0)
