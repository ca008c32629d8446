"""Model shape tables: the logical tensors of a model (names exactly as ``save_pretrained`` writes them,
shapes), each with its *kind*, from a HF-style config dict. Pure Python.

Kinds (how the tensor is laid out for tensor parallelism; the map builders are driven by them):

- ``column``: split along rows (dim 0) under TP (vLLM ``ColumnParallelLinear``; MLA ``q_b_proj``,
  ``kv_b_proj``, a model without q-LoRA's ``q_proj``);
- ``row``: split along columns (the last dim) under TP (``o_proj``, ``down_proj``);
- ``q``/``k``/``v``: a part of vLLM's fused ``qkv_proj`` (heads split; kv heads replicated when TP exceeds
  them);
- ``gate``/``up``: a part of vLLM's fused ``gate_up_proj`` (rows split);
- ``vocab``: ``embed_tokens`` / ``lm_head`` (vocab-parallel, padded);
- ``replicated``: whole on every TP rank (norms, routers, MLA ``q_a_proj``/``kv_a_proj_with_mqa``,
  ``e_score_correction_bias``);
- ``expert_gate``/``expert_up``/``expert_down``: one routed expert's projection (``expert`` and ``layer``
  set).

Which HF models: Qwen3 (``qwen3``), Qwen3-MoE (``qwen3_moe``) and DeepSeek-V3 / Kimi-K2 (``deepseek_v3``,
``kimi_k2``: MLA attention, ``first_k_dense_replace`` dense layers, routed + shared experts). The
DeepSeek-V3 multi-token-prediction layer (``model.layers.61``, ``num_nextn_predict_layers``) is not part of
transformers' ``DeepseekV3ForCausalLM`` and so not of what the trainer saves; it is left out. Key names
follow transformers 5.19 (``models/deepseek_v3/modeling_deepseek_v3.py``, ``models/qwen3*/``): in memory
experts are fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) but
``save_pretrained`` writes per-expert keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError

__all__ = ["EXPERT_KINDS", "KINDS", "LogicalTensor", "ModelTensors", "model_tensors"]

KINDS = frozenset(
    {
        "column",
        "row",
        "q",
        "k",
        "v",
        "gate",
        "up",
        "vocab",
        "replicated",
        "expert_gate",
        "expert_up",
        "expert_down",
    }
)
EXPERT_KINDS = ("expert_gate", "expert_up", "expert_down")


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    """One logical tensor of a model.

    ``dtype`` overrides the side's dtype where the model keeps a tensor in another one (DeepSeek-V3's
    ``e_score_correction_bias`` is float32 in transformers and vLLM). ``buffer``: a module buffer, not a
    parameter: DeepSpeed keeps it whole on every rank (never partitioned, not TP-split). ``in_vllm``:
    False where vLLM keeps no storage for the tensor (it ignores it on load), e.g. the router bias of a
    DeepSeek-V3-style model whose ``topk_method`` is not ``noaux_tc``.
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None = None
    expert: int | None = None
    dtype: str | None = None
    buffer: bool = False
    in_vllm: bool = True


@dataclass(frozen=True, slots=True)
class ModelTensors:
    """All logical tensors of a model plus the facts the builders need (head counts for qkv, expert
    count and MoE intermediate size for experts)."""

    model_type: str
    tensors: tuple[LogicalTensor, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_experts: int = 0
    moe_intermediate_size: int = 0
    tied_embeddings: bool = False

    def by_name(self) -> dict[str, LogicalTensor]:
        return {t.name: t for t in self.tensors}

    @property
    def numel(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for s in t.shape:
                n *= s
            total += n
        return total


def _get(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None and default is None:
        raise LayoutError(
            "model config lacks a field", tensor=str(config.get("model_type")), expected=key, found=None
        )
    return value


def model_tensors(config: Mapping[str, Any]) -> ModelTensors:
    """The logical tensors of the model described by a HF ``config.json`` dict (a multimodal wrapper's
    ``text_config`` is used when present, as for Kimi-K2.5)."""
    if "text_config" in config and isinstance(config["text_config"], Mapping):
        config = config["text_config"]
    model_type = str(config.get("model_type", ""))
    if model_type == "qwen3":
        return _qwen3(config, moe=False)
    if model_type == "qwen3_moe":
        return _qwen3(config, moe=True)
    if model_type in ("deepseek_v3", "kimi_k2"):
        return _deepseek_v3(config)
    raise LayoutError(
        "no shape table for this model type",
        expected="qwen3, qwen3_moe, deepseek_v3 or kimi_k2",
        found=model_type,
    )


def _embeddings(out: list[LogicalTensor], vocab: int, hidden: int, tied: bool) -> None:
    out.append(LogicalTensor("model.embed_tokens.weight", (vocab, hidden), "vocab"))


def _final(out: list[LogicalTensor], vocab: int, hidden: int, tied: bool) -> None:
    out.append(LogicalTensor("model.norm.weight", (hidden,), "replicated"))
    if not tied:
        out.append(LogicalTensor("lm_head.weight", (vocab, hidden), "vocab"))


def _dense_mlp(out: list[LogicalTensor], prefix: str, layer: int, hidden: int, inter: int) -> None:
    out.append(LogicalTensor(f"{prefix}.gate_proj.weight", (inter, hidden), "gate", layer))
    out.append(LogicalTensor(f"{prefix}.up_proj.weight", (inter, hidden), "up", layer))
    out.append(LogicalTensor(f"{prefix}.down_proj.weight", (hidden, inter), "row", layer))


def _experts(out: list[LogicalTensor], prefix: str, layer: int, hidden: int, inter: int, n: int) -> None:
    for e in range(n):
        p = f"{prefix}.experts.{e}"
        out.append(LogicalTensor(f"{p}.gate_proj.weight", (inter, hidden), "expert_gate", layer, e))
        out.append(LogicalTensor(f"{p}.up_proj.weight", (inter, hidden), "expert_up", layer, e))
        out.append(LogicalTensor(f"{p}.down_proj.weight", (hidden, inter), "expert_down", layer, e))


def _qwen3(config: Mapping[str, Any], moe: bool) -> ModelTensors:
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    heads = int(_get(config, "num_attention_heads"))
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(_get(config, "vocab_size"))
    tied = bool(config.get("tie_word_embeddings", False))
    inter = int(config.get("intermediate_size") or 0)
    # transformers 5 writes the expert count of Qwen3-MoE as ``num_local_experts`` (4.x: ``num_experts``).
    n_exp = int(config.get("num_experts") or config.get("num_local_experts") or 0) if moe else 0
    moe_inter = int(config.get("moe_intermediate_size") or 0) if moe else 0
    sparse_step = int(config.get("decoder_sparse_step") or 1)
    mlp_only = set(config.get("mlp_only_layers") or ())
    out: list[LogicalTensor] = []
    _embeddings(out, vocab, hidden, tied)
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out.append(LogicalTensor(f"{p}.input_layernorm.weight", (hidden,), "replicated", i))
        out.append(LogicalTensor(f"{a}.q_proj.weight", (heads * head_dim, hidden), "q", i))
        out.append(LogicalTensor(f"{a}.k_proj.weight", (kv * head_dim, hidden), "k", i))
        out.append(LogicalTensor(f"{a}.v_proj.weight", (kv * head_dim, hidden), "v", i))
        out.append(LogicalTensor(f"{a}.o_proj.weight", (hidden, heads * head_dim), "row", i))
        if bool(config.get("attention_bias", False)):
            out.append(LogicalTensor(f"{a}.q_proj.bias", (heads * head_dim,), "q", i))
            out.append(LogicalTensor(f"{a}.k_proj.bias", (kv * head_dim,), "k", i))
            out.append(LogicalTensor(f"{a}.v_proj.bias", (kv * head_dim,), "v", i))
            out.append(LogicalTensor(f"{a}.o_proj.bias", (hidden,), "replicated", i))
        out.append(LogicalTensor(f"{a}.q_norm.weight", (head_dim,), "replicated", i))
        out.append(LogicalTensor(f"{a}.k_norm.weight", (head_dim,), "replicated", i))
        out.append(LogicalTensor(f"{p}.post_attention_layernorm.weight", (hidden,), "replicated", i))
        is_moe = moe and n_exp > 0 and i not in mlp_only and (i + 1) % sparse_step == 0
        if is_moe:
            out.append(LogicalTensor(f"{p}.mlp.gate.weight", (n_exp, hidden), "replicated", i))
            _experts(out, f"{p}.mlp", i, hidden, moe_inter, n_exp)
        else:
            _dense_mlp(out, f"{p}.mlp", i, hidden, inter)
    _final(out, vocab, hidden, tied)
    return ModelTensors(
        "qwen3_moe" if moe else "qwen3",
        tuple(out),
        heads,
        kv,
        head_dim,
        hidden,
        n_exp,
        moe_inter,
        tied,
    )


def _deepseek_v3(config: Mapping[str, Any]) -> ModelTensors:
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    vocab = int(_get(config, "vocab_size"))
    tied = bool(config.get("tie_word_embeddings", False))
    inter = int(_get(config, "intermediate_size"))
    moe_inter = int(_get(config, "moe_intermediate_size"))
    n_exp = int(_get(config, "n_routed_experts"))
    n_shared = int(config.get("n_shared_experts") or 0)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    q_lora = config.get("q_lora_rank")
    kv_lora = int(_get(config, "kv_lora_rank"))
    nope = int(_get(config, "qk_nope_head_dim"))
    rope = int(_get(config, "qk_rope_head_dim"))
    v_dim = int(_get(config, "v_head_dim"))
    qk_dim = nope + rope
    bias = bool(config.get("attention_bias", False))
    # transformers always has the router bias; vLLM only with ``topk_method: noaux_tc`` in the config
    # (DeepSeek-V3's and Kimi-K2's config.json; vLLM reads it with a None default).
    noaux_tc = config.get("topk_method") == "noaux_tc"
    out: list[LogicalTensor] = []
    _embeddings(out, vocab, hidden, tied)
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out.append(LogicalTensor(f"{p}.input_layernorm.weight", (hidden,), "replicated", i))
        if q_lora is None:
            out.append(LogicalTensor(f"{a}.q_proj.weight", (heads * qk_dim, hidden), "column", i))
        else:
            q_lora = int(q_lora)
            out.append(LogicalTensor(f"{a}.q_a_proj.weight", (q_lora, hidden), "replicated", i))
            if bias:
                out.append(LogicalTensor(f"{a}.q_a_proj.bias", (q_lora,), "replicated", i))
            out.append(LogicalTensor(f"{a}.q_a_layernorm.weight", (q_lora,), "replicated", i))
            out.append(LogicalTensor(f"{a}.q_b_proj.weight", (heads * qk_dim, q_lora), "column", i))
        out.append(LogicalTensor(f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), "replicated", i))
        if bias:
            out.append(LogicalTensor(f"{a}.kv_a_proj_with_mqa.bias", (kv_lora + rope,), "replicated", i))
        out.append(LogicalTensor(f"{a}.kv_a_layernorm.weight", (kv_lora,), "replicated", i))
        out.append(LogicalTensor(f"{a}.kv_b_proj.weight", (heads * (nope + v_dim), kv_lora), "column", i))
        out.append(LogicalTensor(f"{a}.o_proj.weight", (hidden, heads * v_dim), "row", i))
        if bias:
            out.append(LogicalTensor(f"{a}.o_proj.bias", (hidden,), "replicated", i))
        out.append(LogicalTensor(f"{p}.post_attention_layernorm.weight", (hidden,), "replicated", i))
        if i >= first_dense and i % freq == 0:
            m = f"{p}.mlp"
            out.append(LogicalTensor(f"{m}.gate.weight", (n_exp, hidden), "replicated", i))
            out.append(
                LogicalTensor(
                    f"{m}.gate.e_score_correction_bias",
                    (n_exp,),
                    "replicated",
                    i,
                    dtype="float32",
                    buffer=True,
                    in_vllm=noaux_tc,
                )
            )
            _experts(out, m, i, hidden, moe_inter, n_exp)
            if n_shared:
                _dense_mlp(out, f"{m}.shared_experts", i, hidden, moe_inter * n_shared)
        else:
            _dense_mlp(out, f"{p}.mlp", i, hidden, inter)
    _final(out, vocab, hidden, tied)
    return ModelTensors(
        str(config.get("model_type")),
        tuple(out),
        heads,
        kv_heads,
        qk_dim,
        hidden,
        n_exp,
        moe_inter,
        tied,
    )
