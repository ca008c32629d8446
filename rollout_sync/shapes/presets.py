"""Published shape numbers of real models, as HF ``config.json`` dicts (shape fields only).

Sources: the models' ``config.json`` on the Hugging Face Hub (``Qwen/Qwen3-8B``, ``Qwen/Qwen3-0.6B``,
``Qwen/Qwen3-30B-A3B``, ``Qwen/Qwen3-235B-A22B``, ``deepseek-ai/DeepSeek-V3``,
``moonshotai/Kimi-K2-Instruct``). The hub is not reachable from here; the values were checked against
copies of those configs quoted in public code found with the search tool (e.g. slime
``scripts/models/qwen3-235B-A22B.sh``, Megatron-FSDP conversion tests' ``HF_QWEN3_MOE_TOY_MODEL_CONFIG``
with the 30B-A3B dims, vLLM/sglang-style test fixtures quoting ``config_Deepseek_R1`` / ``DEEPSEEK_V3``,
Kimi-K2.5's ``text_config``, and an hf-model-inspector report of ``moonshotai/Kimi-K2-Instruct-0905``).
Quantization fields are dropped: the tables describe shapes of the bf16 logical tensors.
"""

from __future__ import annotations

from typing import Any

from ..errors import LayoutError
from .tensors import ModelTensors, model_tensors

__all__ = ["PRESETS", "preset", "preset_config"]

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-8B config.json
    "qwen3-8b": {
        "model_type": "qwen3",
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # Qwen/Qwen3-0.6B config.json
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 94,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # deepseek-ai/DeepSeek-V3 config.json (num_nextn_predict_layers = 1: the MTP layer is not modelled)
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # moonshotai/Kimi-K2-Instruct config.json (architecture DeepseekV3ForCausalLM, model_type kimi_k2)
    "kimi-k2": {
        "model_type": "kimi_k2",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 163840,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A copy of a preset's config dict."""
    if name not in PRESETS:
        raise LayoutError("unknown model preset", expected=sorted(PRESETS), found=name)
    return dict(PRESETS[name])


def preset(name: str) -> ModelTensors:
    """The logical tensors of a preset model."""
    return model_tensors(preset_config(name))
