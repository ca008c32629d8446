"""Shared fixtures and markers.

Markers (declared in pyproject.toml): ``vllm`` (starts a real vLLM CPU engine), ``deepspeed`` (starts real
DeepSpeed engines on CPU ranks), ``gpu`` (needs CUDA). The default command (``python -m pytest``) runs all
but ``gpu`` (``addopts = -m 'not gpu'``); a ``gpu`` test selected explicitly is skipped when CUDA is
absent. ``vllm`` / ``deepspeed`` tests are skipped, with the reason, when that package is not installed.

Fixtures:
- ``tiny_model(kind="dense", seed=0) -> Path``: a tiny checkpoint (``rollout_sync.testing.tiny_models``),
  built once per session (or once per machine with ``ROLLOUT_SYNC_TEST_CACHE=<dir>``).
- ``vllm_pool``: the session's ``VllmEnginePool``; ``vllm_pool.get(shared_spec(path, tp))`` returns a
  shared running engine, ``vllm_pool.restore(engine)`` puts its start weights back after a test changed
  them. The modules that use it run last, in ``ENGINE_MODULE_ORDER``, so that consecutive modules reuse
  engines. All engines are shut down at the end of the session, and a process left behind fails the run.

Harness timings (model builds, engine start-ups) are printed in the terminal summary. A process that a
test started and that is still alive when the session ends is listed, killed, and fails the run.
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


#: Modules that use the shared vLLM engines, in the order that lets consecutive modules reuse them (pool
#: capacity 2; see each module for its engines). They run after every other test, in this order.
ENGINE_MODULE_ORDER = (
    "tests/smoke/test_vllm_smoke.py",  # dense seed 0, TP 2
    "tests/e2e/test_e2e_weight_transfer.py",  # dense seed 0, TP 2
    "tests/e2e/test_e2e_sync.py",  # dense seed 0, TP 2; then MoE seed 0, TP 2
    "tests/vllm/test_rollout_apply.py",  # MoE seeds 0 and 1, TP 2; then dense seeds 0 and 1, TP 1
    "tests/vllm/test_rollout_backend.py",  # MoE seed 1, TP 2, expert parallel
    "tests/vllm/test_dry_run_matches_live_rollout.py",  # the same EP engine; then dense-tied seed 0, TP 2
    "tests/vllm/test_rollout_engines.py",  # dense-tied seeds 0 and 1, TP 2
)


def _order_engine_modules(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    rank = {name: i + 1 for i, name in enumerate(ENGINE_MODULE_ORDER)}

    def key(pair: tuple[int, pytest.Item]) -> tuple[int, int]:
        index, item = pair
        try:
            module = Path(str(item.path)).relative_to(root).as_posix()
        except ValueError:
            module = ""
        return rank.get(module, 0), index

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _order_engine_modules(config, items)
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


_LEFTOVERS_KEY = pytest.StashKey[list[str]]()
# Started once by Python's multiprocessing and kept until this process exits; not a leak.
_PROCESS_LIFETIME_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.hookimpl(trylast=True)  # after the runner has torn down session fixtures (the engine pool)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every process a test started must be gone by now (engines shut down, ranks joined). Any that is not
    is listed in the summary, killed by pid, and fails the run."""
    try:
        import psutil
    except ImportError:
        return
    leftovers = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
            if any(helper in cmdline for helper in _PROCESS_LIFETIME_HELPERS):
                continue
            leftovers.append(f"pid {proc.pid}: {proc.name()} {cmdline[:120]}")
            proc.kill()
        except psutil.Error:
            continue
    session.config.stash[_LEFTOVERS_KEY] = leftovers
    if leftovers and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    leftovers = terminalreporter.config.stash.get(_LEFTOVERS_KEY, [])
    if leftovers:
        terminalreporter.section("processes left running by the tests (killed; the run fails)", red=True)
        for line in leftovers:
            terminalreporter.write_line(line)
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

    pool = VllmEnginePool(capacity=int(os.environ.get("ROLLOUT_SYNC_TEST_VLLM_ENGINES", "2")))
    try:
        yield pool
    finally:
        pool.close()
