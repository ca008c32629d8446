"""The small Qwen3 of the engine-free session tests (``tests/multiproc/test_session.py``, and
``tests/hosts/session_rank.py`` across emulated hosts): its config, and its full tensors for a seed (the
trainer's values at a version)."""

from __future__ import annotations

import torch

from rollout_sync.shapes import model_tensors

__all__ = ["CONFIG", "TRAINERS", "WORKERS", "full_tensors", "step_tensors", "stepped_tensors"]

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


def step_tensors(full: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """``full`` after an optimizer step that moved ``share`` of every tensor's elements (each by at least one
    bf16 ulp, at positions drawn from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in full.items():
        t = t.clone()
        flat = t.view(-1)
        hit = torch.rand(flat.shape, generator=g) < share
        flat[hit] = (flat[hit].float() * 1.01 + 1e-3).to(t.dtype)
        out[name] = t
    return out


def stepped_tensors(version: int, share: float) -> dict[str, torch.Tensor]:
    """The trainer's values at ``version`` when version 1 is ``full_tensors(1)`` and every later version is
    one ``step_tensors`` (``share``, seeded by the version) away from the one before."""
    full = full_tensors(1)
    for k in range(2, version + 1):
        full = step_tensors(full, share, k)
    return full
