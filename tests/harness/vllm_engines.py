"""Real vLLM CPU engines for tests: start with settings that work on a small CPU machine, share, shut down.

An engine start costs 20-70 s here, so tests share engines through a ``VllmEnginePool`` (one per pytest
session, see ``tests/conftest.py``): ``pool.get(spec)`` returns the running engine for an equal spec, or
starts one, first shutting down the least recently used engine when the pool is full (default capacity 2,
``ROLLOUT_SYNC_TEST_VLLM_ENGINES`` to change it). Most tests use ``shared_spec(model, tp)`` (one test
extension, ``tests/harness/vllm_ext.py``), so tests of one model and TP size share an engine, and
``tests/conftest.py`` orders the engine test modules so that consecutive modules reuse engines. A test
that changes an engine's weights calls ``pool.restore(engine)`` (writes the start checkpoint back through
the maps and keeps the engine only if every parameter then equals its start digest, else shuts it down)
or ``pool.discard(engine)``, so that the next user gets an engine as started.

Facts this module encodes (``/work/shared/notes/vllm-on-cpu.md``):
- vLLM spawns its engine core and workers; the worker extension must be importable there, so the repo root
  (and ``extra_pythonpath``) goes on ``PYTHONPATH`` while the engine starts.
- TP > 1 on CPU needs ``VLLM_CPU_OMP_THREADS_BIND`` (``auto`` refuses two workers on one NUMA node); we
  give each TP rank its own share of the allowed cores, ``"0|1"`` on a 2-core machine.
- ``kv_cache_memory_bytes`` keeps memory small and skips the RAM check; ``enforce_eager`` skips compilation.
- After a ``collective_rpc`` that failed at TP > 1, the next call once returned the previous call's error:
  a test that provokes a failure must ``discard`` the engine afterwards.

Shutdown waits for every process the engine started to exit and raises ``LeftoverProcessError`` if one
does not (after killing it by pid), so leaked workers fail the run instead of hiding.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.harness import timings
from vllm_plugin.registration import BACKEND

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Engine arguments that work on a 2-core CPU machine with the tiny models (measured, see module doc).
CPU_ENGINE_DEFAULTS: Mapping[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 64 * 2**20,
    "seed": 0,
}

#: Engine arguments under which ``VllmEngine.logits`` returns every token's raw logit.
LOGITS_KWARGS: Mapping[str, Any] = {"max_logprobs": -1, "logprobs_mode": "raw_logits"}

#: Two prompts of token ids inside the tiny vocabulary, used when a test does not care which.
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = ((5, 6, 7, 8, 9), (100, 200, 300))

_SHUTDOWN_TIMEOUT_S = 60.0


class LeftoverProcessError(RuntimeError):
    """Processes started by an engine were still alive after its shutdown (they have been killed)."""


@dataclass(frozen=True)
class FrozenArg:
    """A mapping engine argument (``weight_transfer_config={...}``) kept hashable inside a spec."""

    items: tuple[tuple[str, Any], ...]

    def thaw(self) -> dict[str, Any]:
        return dict(self.items)


@dataclass(frozen=True)
class VllmEngineSpec:
    """Everything that makes two engines interchangeable. Equal specs share one engine in a pool.

    ``engine_kwargs`` overrides or extends ``CPU_ENGINE_DEFAULTS`` (a tuple of pairs, so the spec stays
    hashable); ``extra_pythonpath`` names directories the spawned workers must import from.
    ``enable_expert_parallel`` starts, but vLLM-CPU 0.32's fused-MoE kernel ignores the expert map and
    crashes on the first generate; a test that needs EP must apply the workaround in
    ``notes/vllm-ep-plugin-serve.md`` itself (openly, in its setup), the harness does not.
    """

    model: str
    tensor_parallel_size: int = 1
    worker_extension_cls: str | None = None
    enable_expert_parallel: bool = False
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    extra_pythonpath: tuple[str, ...] = ()

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(CPU_ENGINE_DEFAULTS)
        overrides = {k: v.thaw() if isinstance(v, FrozenArg) else v for k, v in self.engine_kwargs}
        kwargs["model"] = self.model
        kwargs["tensor_parallel_size"] = self.tensor_parallel_size
        if self.worker_extension_cls is not None:
            kwargs["worker_extension_cls"] = self.worker_extension_cls
        if self.enable_expert_parallel:
            kwargs["enable_expert_parallel"] = True
        kwargs.update(overrides)
        return kwargs


def vllm_spec(
    model: str | os.PathLike[str],
    tp: int = 1,
    *,
    worker_extension_cls: str | None = None,
    enable_expert_parallel: bool = False,
    extra_pythonpath: Sequence[str | os.PathLike[str]] = (),
    **engine_kwargs: Any,
) -> VllmEngineSpec:
    """Shorthand for ``VllmEngineSpec`` with keyword engine overrides (``vllm_spec(path, 2, seed=1)``)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, found {tp}")
    return VllmEngineSpec(
        model=str(model),
        tensor_parallel_size=tp,
        worker_extension_cls=worker_extension_cls,
        enable_expert_parallel=enable_expert_parallel,
        engine_kwargs=tuple(
            sorted(
                (k, FrozenArg(tuple(sorted(v.items()))) if isinstance(v, dict) else v)
                for k, v in engine_kwargs.items()
            )
        ),
        extra_pythonpath=tuple(str(p) for p in extra_pythonpath),
    )


#: vLLM's weight-transfer API with this project's backend (``vllm_plugin.weight_transfer``).
WEIGHT_TRANSFER_CONFIG: Mapping[str, Any] = {"backend": BACKEND}


def shared_spec(model: str | os.PathLike[str], tp: int = 1, **engine_kwargs: Any) -> VllmEngineSpec:
    """The spec tests use unless they need something else: the test extension (the product's extension
    plus test tools, ``tests/harness/vllm_ext.py``) and the weight-transfer backend, so that every test of
    one model and TP size shares one engine."""
    from tests.harness.vllm_ext import TEST_EXTENSION

    engine_kwargs.setdefault("weight_transfer_config", dict(WEIGHT_TRANSFER_CONFIG))
    return vllm_spec(model, tp, worker_extension_cls=TEST_EXTENSION, **engine_kwargs)


def omp_threads_bind(tp: int, cpus: Sequence[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``tp`` workers a disjoint, non-empty share of ``cpus``
    (the cores this process may use). ``"0|1"`` for TP 2 on cores {0, 1}."""
    allowed = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if tp > len(allowed):
        raise ValueError(
            f"tensor parallel size {tp} needs at least {tp} cores to bind one worker per core, "
            f"found {len(allowed)} allowed cores {allowed}"
        )
    share, extra = divmod(len(allowed), tp)
    groups: list[str] = []
    start = 0
    for rank in range(tp):
        size = share + (1 if rank < extra else 0)
        group = allowed[start : start + size]
        start += size
        groups.append(",".join(str(c) for c in group))
    return "|".join(groups)


@contextlib.contextmanager
def _patched_environ(updates: Mapping[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _engine_environ(spec: VllmEngineSpec) -> dict[str, str]:
    paths = [str(REPO_ROOT), *spec.extra_pythonpath]
    existing = os.environ.get("PYTHONPATH")
    if existing:
        paths.append(existing)
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    if spec.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(spec.tensor_parallel_size)
    return env


# Helpers that Python's multiprocessing starts once and keeps for the life of the parent process; they
# belong to the test process, not to an engine.
_PROCESS_LIFETIME_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _descendants() -> set[int]:
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.cmdline())
            if not any(helper in cmdline for helper in _PROCESS_LIFETIME_HELPERS):
                pids.add(proc.pid)
    return pids


@dataclass
class VllmEngine:
    """A running ``vllm.LLM`` plus what the harness knows about it."""

    spec: VllmEngineSpec
    llm: Any
    startup_s: float
    pids: frozenset[int]
    closed: bool = field(default=False)
    #: Every worker's parameter digests right after the start (``VllmEnginePool.restore`` compares).
    start_digests: list[dict[str, str]] | None = None

    def generate_greedy(
        self, prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS, max_tokens: int = 12
    ) -> list[list[int]]:
        """Greedy token ids for token-id prompts (``ignore_eos`` so every output has ``max_tokens``)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def logits(
        self, prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS, max_tokens: int = 4
    ) -> list[list[list[float]]]:
        """Per prompt, per generated position (greedy), the value vLLM reports for every token of the
        vocabulary, in token order: the raw logits on an engine started with ``LOGITS_KWARGS``."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=-1)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        out = []
        for o in outputs:
            positions = o.outputs[0].logprobs or []
            out.append([[v.logprob for _, v in sorted(pos.items())] for pos in positions])
        return out

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """``LLM.collective_rpc``: one result per worker, in worker rank order."""
        return list(self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs))

    def alive_pids(self) -> list[int]:
        return [pid for pid in self.pids if psutil.pid_exists(pid) and _is_running(pid)]

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the engine core and workers; raise ``LeftoverProcessError`` if any process outlives it."""
        if self.closed:
            return
        self.closed = True
        started = time.perf_counter()
        try:
            self.llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
        finally:
            self.llm = None
            leftovers = _wait_gone(self.pids, timeout_s)
            timings.record(
                f"vLLM engine shutdown: {Path(self.spec.model).name}, TP {self.spec.tensor_parallel_size}",
                time.perf_counter() - started,
            )
            if leftovers:
                for pid in leftovers:
                    with contextlib.suppress(psutil.Error):
                        psutil.Process(pid).kill()
                raise LeftoverProcessError(
                    f"vLLM engine {self.spec} left processes alive after shutdown: expected none, "
                    f"found pids {sorted(leftovers)} (killed)"
                )


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(pids: frozenset[int], timeout_s: float) -> list[int]:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive if _is_running(p.pid)]


def _restorable(spec: VllmEngineSpec) -> bool:
    """Engines with the test extension (or a subclass of it) can have their start weights written back."""
    if spec.worker_extension_cls is None:
        return False
    import importlib

    module, _, name = spec.worker_extension_cls.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    from tests.harness.vllm_ext import TestWorkerExtension

    return isinstance(cls, type) and issubclass(cls, TestWorkerExtension)


def start_vllm_engine(spec: VllmEngineSpec) -> VllmEngine:
    """Start one engine for ``spec`` (blocking, 20-70 s on 2 cores) and record the processes it started."""
    with _patched_environ(_engine_environ(spec)):
        from vllm import LLM

        before = _descendants()
        started = time.perf_counter()
        llm = LLM(**spec.llm_kwargs())
        startup_s = time.perf_counter() - started
        pids = frozenset(_descendants() - before)
    if _restorable(spec):  # the test tools: the workaround for vLLM's AMX bug before anything generates
        llm.collective_rpc("rs_harness_request_amx")
    kind = Path(spec.model).name
    timings.record(f"vLLM engine startup: {kind}, TP {spec.tensor_parallel_size}", startup_s)
    return VllmEngine(spec=spec, llm=llm, startup_s=startup_s, pids=pids)


class VllmEnginePool:
    """Engines shared across tests, keyed by spec, at most ``capacity`` alive at once (LRU eviction)."""

    def __init__(self, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"pool capacity must be >= 1, found {capacity}")
        self.capacity = capacity
        self._engines: OrderedDict[VllmEngineSpec, VllmEngine] = OrderedDict()
        #: (spec, startup seconds) for every engine this pool started, in order.
        self.started: list[tuple[VllmEngineSpec, float]] = []

    def get(self, spec: VllmEngineSpec) -> VllmEngine:
        engine = self._engines.get(spec)
        if engine is not None and not engine.closed:
            self._engines.move_to_end(spec)
            return engine
        self._engines.pop(spec, None)
        while len(self._engines) >= self.capacity:
            _, oldest = self._engines.popitem(last=False)
            oldest.shutdown()
        engine = start_vllm_engine(spec)
        self._engines[spec] = engine
        self.started.append((spec, engine.startup_s))
        if _restorable(spec):
            engine.start_digests = [dict(d) for d in engine.collective_rpc("rollout_sync_param_digests")]
        return engine

    def restore(self, engine: VllmEngine) -> bool:
        """After a test changed ``engine``'s weights: write the checkpoint it was started from back through
        its maps (test loaders restored, targets probed again, derived copies rebuilt, prefix cache reset)
        and keep it for the next test if every worker's parameters then equal, bit for bit, what they held
        right after the start; otherwise (no digests, a failed call, a differing digest) shut it down.
        Returns whether it was kept. Cheaper than a restart (about a second against 30-40 s)."""
        if engine.closed or self._engines.get(engine.spec) is not engine or engine.start_digests is None:
            self.discard(engine)
            return False
        started = time.perf_counter()
        try:
            engine.collective_rpc("rs_rollout_test_restore_loaders")
            engine.collective_rpc("rollout_sync_setup")
            engine.collective_rpc("rollout_sync_apply_checkpoint", args=(engine.spec.model, None))
            engine.llm.reset_prefix_cache()
            digests = [dict(d) for d in engine.collective_rpc("rollout_sync_param_digests")]
        except Exception:
            digests = None
        kept = digests == engine.start_digests
        kind = Path(engine.spec.model).name
        timings.record(
            f"vLLM engine restore ({'kept' if kept else 'differs: discarded'}): {kind}, "
            f"TP {engine.spec.tensor_parallel_size}",
            time.perf_counter() - started,
        )
        if not kept:
            self.discard(engine)
        return kept

    def discard(self, engine: VllmEngine) -> None:
        """Shut ``engine`` down now (its weights or state were changed); the next ``get`` starts afresh."""
        if self._engines.get(engine.spec) is engine:
            del self._engines[engine.spec]
        engine.shutdown()

    def close(self) -> None:
        """Shut every engine down; raise the first ``LeftoverProcessError`` after trying them all."""
        errors: list[BaseException] = []
        while self._engines:
            _, engine = self._engines.popitem(last=False)
            try:
                engine.shutdown()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
