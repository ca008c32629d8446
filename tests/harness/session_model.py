"""The small Qwen3 of the engine-free session tests (``tests/multiproc/test_session.py``, and
``tests/hosts/session_rank.py`` across emulated hosts): its config, and its full tensors for a seed (the
trainer's values at a version)."""

from __future__ import annotations

import torch

from rollout_sync.shapes import model_tensors

__all__ = ["CONFIG", "TRAINERS", "WORKERS", "full_tensors"]

CONFIG = {
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
TRAINERS, WORKERS = 2, 2


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in model_tensors(CONFIG).tensors
    }
