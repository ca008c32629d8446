"""Checkpoints with a published model's shapes and locally drawn random weights (no download), for
benchmarks at a realistic size.

``make_shaped_model("qwen3-0.6b-shapes", path)`` writes Qwen3-0.6B's architecture (28 layers, hidden 1024,
16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings), bf16, weights from a
seeded generator (matrices N(0, 0.02), norms 1 + N(0, 0.1)), and a word-level tokenizer like
``tiny_models`` builds. A stamped build is reused; a build goes to a temporary sibling that is renamed into
place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollout_sync.tiny import TinyModelSpec, _hf_config, _save_tokenizer, build_stamped

__all__ = ["SHAPED_KINDS", "make_shaped_model", "shaped_spec"]

# Qwen3-0.6B's shapes; the same with 14 of its 28 layers (where both sides of two colocated processes must
# fit in a small machine's memory: the TRL benchmark).
SHAPED_KINDS = ("qwen3-0.6b-shapes", "qwen3-0.6b-shapes-14-layers")
_STAMP = "rollout_sync_shaped.json"
_RECIPE_VERSION = 1


def shaped_spec(kind: str) -> TinyModelSpec:
    if kind not in SHAPED_KINDS:
        raise ValueError(f"unknown shaped model kind {kind!r}: expected one of {SHAPED_KINDS}")
    return TinyModelSpec(
        kind="dense-tied",
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=14 if kind.endswith("-14-layers") else 28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def make_shaped_model(kind: str, path: str | os.PathLike[str], seed: int = 0) -> Path:
    spec = shaped_spec(kind)
    stamp: dict[str, Any] = {"kind": kind, "seed": seed, "recipe_version": _RECIPE_VERSION}
    return build_stamped(Path(path), _STAMP, stamp, lambda out: _build(spec, seed, out))


def _build(spec: TinyModelSpec, seed: int, out: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    config = _hf_config(spec)
    config.dtype = "bfloat16"
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_(1.0 + 0.1 * draw if name.endswith("norm.weight") else 0.02 * draw)
            del draw
    model.config.dtype = "bfloat16"
    model.save_pretrained(out)
    _save_tokenizer(spec, out)
