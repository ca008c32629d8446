"""Tiny checkpoints for tests: re-exported from the product (``rollout_sync.tiny``), where the
README demo and the examples also find them. The pytest fixtures that cache them per run are in
``tests/conftest.py``."""

from rollout_sync.tiny import TINY_KINDS, TinyKind, TinyModelSpec, make_tiny_model, tiny_spec

__all__ = ["TINY_KINDS", "TinyKind", "TinyModelSpec", "make_tiny_model", "tiny_spec"]
