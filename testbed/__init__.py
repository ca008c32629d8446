"""Helpers for tests, examples and the README demo. Nothing in the sync path imports this package."""

from rollout_sync.tiny import TINY_KINDS, TinyKind, TinyModelSpec, make_tiny_model, tiny_spec

__all__ = ["TINY_KINDS", "TinyKind", "TinyModelSpec", "make_tiny_model", "tiny_spec"]
