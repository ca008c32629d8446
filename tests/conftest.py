"""Shared fixtures and markers.

Markers (declared in pyproject.toml): ``vllm`` (starts a real vLLM CPU engine), ``deepspeed`` (starts real
DeepSpeed engines on CPU ranks), ``gpu`` (needs CUDA). The default command (``python -m pytest``) runs all
but ``gpu`` (``addopts = -m 'not gpu'``); a ``gpu`` test selected explicitly is skipped when CUDA is
absent. ``vllm`` / ``deepspeed`` tests are skipped, with the reason, when that package is not installed.

Fixtures:
- ``tiny_model(kind="dense", seed=0) -> Path``: a tiny checkpoint (``rollout_sync.testing.tiny_models``),
  built once per session (or once per machine with ``ROLLOUT_SYNC_TEST_CACHE=<dir>``).
- ``vllm_pool``: the session's ``VllmEnginePool``; ``vllm_pool.get(vllm_spec(path, tp, ...))`` returns a
  shared running engine. All engines are shut down at the end of the session, and a process left behind
  fails the run.

Harness timings (model builds, engine start-ups) are printed in the terminal summary.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness import timings
from tests.harness.tiny_models import TinyKind, make_tiny_model

TinyModelFactory = Callable[..., Path]


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {
        "gpu": (_cuda_available, "needs CUDA, which this machine does not have"),
        "vllm": (lambda: importlib.util.find_spec("vllm") is not None, "vLLM is not installed"),
        "deepspeed": (
            lambda: importlib.util.find_spec("deepspeed") is not None,
            "DeepSpeed is not installed",
        ),
    }
    available: dict[str, bool] = {}
    for item in items:
        for marker, (probe, reason) in needs.items():
            if marker not in item.keywords:
                continue
            if marker not in available:
                available[marker] = probe()
            if not available[marker]:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    figures = timings.records()
    if not figures:
        return
    terminalreporter.section("rollout-sync harness timings")
    for label, seconds in figures:
        terminalreporter.write_line(f"{seconds:8.1f} s  {label}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where tiny checkpoints live: ``ROLLOUT_SYNC_TEST_CACHE`` if set (kept across runs), else a
    session temporary directory."""
    cache = os.environ.get("ROLLOUT_SYNC_TEST_CACHE")
    if cache:
        path = Path(cache) / "tiny_models"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> TinyModelFactory:
    """``tiny_model(kind="dense", seed=0) -> Path`` of a tiny checkpoint, built once per session."""

    def get(kind: TinyKind = "dense", seed: int = 0) -> Path:
        path = tiny_model_dir / f"{kind}-seed{seed}"
        if (path / "config.json").exists():
            return make_tiny_model(kind, path, seed)  # reuses a stamped build, rebuilds a stale one
        if "transformers" not in sys.modules:
            with timings.timed("import torch + transformers (first tiny model build)"):
                import transformers  # noqa: F401
        with timings.timed(f"tiny model build: {kind}, seed {seed}"):
            return make_tiny_model(kind, path, seed)

    return get


@pytest.fixture(scope="session")
def vllm_pool() -> Iterator[object]:
    """The session's pool of running vLLM CPU engines (see ``tests/harness/vllm_engines.py``)."""
    from tests.harness.vllm_engines import VllmEnginePool

    pool = VllmEnginePool(capacity=int(os.environ.get("ROLLOUT_SYNC_TEST_VLLM_ENGINES", "1")))
    try:
        yield pool
    finally:
        pool.close()
