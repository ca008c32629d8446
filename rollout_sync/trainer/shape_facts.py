"""Dry run: the layout facts of a DeepSpeed engine from a model's shape table and a layout description
alone (no engine, no torch), so that ``state_maps`` gives the same maps as the live adapter, for every
state (parameters, fp32 master weights, Adam states). The scale simulation uses this.

What a live engine would hold, following DeepSpeed 0.19.8 on transformers 5.19 (checked against live
engines by ``tests/deepspeed/test_trainer_storage.py``):

- parameters in the order the model registers them (it decides ZeRO-1/2 flat offsets): embeddings, per
  layer ``self_attn`` (q, k, v, o projections and their biases, q/k norms), the MLP (``gate_proj``,
  ``up_proj``, ``down_proj``; a Qwen3-MoE block: fused ``experts.gate_up_proj``, ``experts.down_proj``,
  then ``gate``; under AutoEP: ``router.gate``, packed ``experts.w1``, ``w2``, ``w3``), the two layer norms,
  then the final norm and ``lm_head``;
- AutoTP (``rollout_sync.geometry.deepspeed.autotp_shape_layout`` with ``tied``: a tied embedding is split along the vocab
  like the ``lm_head`` it is, since AutoTP partitions ``lm_head``, which shares the parameter);
- AutoEP: EP rank ``k`` packs experts ``[k·E/ep, (k+1)·E/ep)``; EP groups are consecutive ranks, the
  expert-data-parallel group of EP rank ``k`` is ``[k, k + ep, ...]``; ZeRO-1/2 put the experts in their
  own optimizer group (flat buffer) over that group, the other parameters in one group over all ranks;
- ZeRO-1/2 flat buffers: ``rollout_sync.geometry.deepspeed`` (``parameter_alignment`` and
  ``round_robin_gradients`` as configured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from ..errors import LayoutError, UnsupportedLayoutError
from ..geometry.deepspeed import (
    autotp_shape_layout,
    param_alignment_for,
    round_robin_order,
    trainer_rank_table,
    zero12_flat_layout,
)
from ..layout.shards import Layout
from ..shapes.tensors import LogicalTensor, ModelTensors
from .facts import LogicalPart, ParamFacts, TrainerFacts, ZeroGroup
from .naming import autoep_expert_parts, fused_expert_parts, plain_parts
from .placement import autoep_layout, single_layout

__all__ = ["dry_run_facts"]

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_LAYER_ORDER = (
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.o_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


@dataclass
class _Param:
    name: str
    layout: Layout
    groups: dict[int, tuple[int, ...]]
    parts: tuple[LogicalPart, ...]
    expert: bool


def dry_run_facts(
    model: ModelTensors,
    zero_stage: int,
    dp: int,
    tp: int = 1,
    ep: int = 1,
    dtype: str = "bfloat16",
    master_dtype: str = "float32",
    *,
    parameter_alignment: bool = False,
    round_robin: bool = False,
    tp_grain: int = 1,
) -> TrainerFacts:
    """The facts a DeepSpeed engine of ``dp × tp`` ranks (AutoEP size ``ep``) would hold for ``model``."""
    if model.model_type not in ("qwen3", "qwen3_moe"):
        raise UnsupportedLayoutError(
            "no DeepSpeed parameter order known for this model type",
            expected="qwen3 or qwen3_moe",
            found=model.model_type,
        )
    if zero_stage not in (0, 1, 2, 3):
        raise LayoutError("unknown ZeRO stage", expected="0, 1, 2 or 3", found=zero_stage)
    if ep > 1 and (tp > 1 or dp % ep or model.num_experts % ep):
        raise UnsupportedLayoutError(
            "AutoEP needs tp == 1 and ep dividing dp and the expert count",
            expected=(1, dp, model.num_experts),
            found=(tp, ep),
        )
    table = trainer_rank_table(dp, tp)
    by_name = model.by_name()
    params: list[_Param] = []

    def dense(t: LogicalTensor) -> None:
        if tp > 1:
            layout = autotp_shape_layout(t, tp, model.num_kv_heads, tp_grain, tied=model.tied_embeddings)
        else:
            layout = single_layout(t.name, t.shape)
        params.append(
            _Param(t.name, layout, {k: table[k] for k in layout.shards}, plain_parts(t.name, t.shape), False)
        )

    dense(by_name["model.embed_tokens.weight"])
    layers = sorted({t.layer for t in model.tensors if t.layer is not None})
    for i in layers:
        prefix = f"model.layers.{i}"
        for key in _LAYER_ORDER:
            if key != "mlp":
                t = by_name.get(f"{prefix}.{key}")
                if t is not None:
                    dense(t)
                continue
            if f"{prefix}.mlp.gate_proj.weight" in by_name:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    dense(by_name[f"{prefix}.mlp.{proj}.weight"])
            else:
                _moe_block(model, f"{prefix}.mlp", ep, table[0], params, dense)
    dense(by_name["model.norm.weight"])
    if "lm_head.weight" in by_name:
        dense(by_name["lm_head.weight"])

    zero_groups: dict[str, dict[int, ZeroGroup]] = {
        p.name: {k: ZeroGroup(r) for k, r in p.groups.items()} for p in params
    }
    if zero_stage in (1, 2):
        align = param_alignment_for(_ITEMSIZE[dtype], parameter_alignment)
        for expert in (False, True):
            group = [p for p in params if p.expert == expert]
            if not group:
                continue
            order = (
                round_robin_order(len(group), len(next(iter(group[0].groups.values()))))
                if round_robin
                else None
            )
            flat = [group[j] for j in order] if order is not None else group
            for k in flat[0].layout.shards:
                size = len(flat[0].groups[k])
                offsets, total = zero12_flat_layout(
                    [prod(p.layout.shards[k].shape) for p in flat], size, param_alignment=align
                )
                for p, o in zip(flat, offsets, strict=True):
                    zero_groups[p.name][k] = ZeroGroup(p.groups[k], o, total)
    facts = tuple(
        ParamFacts(p.name, tuple(p.layout.shape), p.layout, zero_groups[p.name], p.parts) for p in params
    )
    return TrainerFacts(zero_stage, dtype, master_dtype if zero_stage > 0 else None, facts)


def _moe_block(
    model: ModelTensors,
    block: str,
    ep: int,
    world: tuple[int, ...],
    params: list[_Param],
    dense: Callable[[LogicalTensor], None],
) -> None:
    by_name = model.by_name()
    e_count, inter, hidden = model.num_experts, model.moe_intermediate_size, model.hidden_size
    router = by_name[f"{block}.gate.weight"]
    if ep == 1:
        for name, shape in (
            ("gate_up_proj", (e_count, 2 * inter, hidden)),
            ("down_proj", (e_count, hidden, inter)),
        ):
            ds_name = f"{block}.experts.{name}"
            layout = single_layout(ds_name, shape)
            params.append(_Param(ds_name, layout, {0: world}, fused_expert_parts(block, name, shape), False))
        dense(router)
        return
    local = e_count // ep
    placement = {
        "num_experts": e_count,
        "ranks": [{"rank": k, "experts": list(range(k * local, (k + 1) * local))} for k in range(ep)],
    }
    edp = {k: tuple(range(k, len(world), ep)) for k in range(ep)}
    ds_router = f"{block}.router.gate.weight"
    params.append(
        _Param(
            ds_router,
            single_layout(ds_router, router.shape),
            {0: world},
            plain_parts(router.name, router.shape),
            False,
        )
    )
    for packed, shape in (
        ("w1", (e_count, inter, hidden)),
        ("w2", (e_count, hidden, inter)),
        ("w3", (e_count, inter, hidden)),
    ):
        ds_name = f"{block}.experts.{packed}"
        layout = autoep_layout(ds_name, shape, placement)
        params.append(
            _Param(
                ds_name, layout, dict(edp), autoep_expert_parts(model.model_type, block, packed, shape), True
            )
        )
