"""While a rollout-sync call runs on an engine's workers, the engine core waits for their replies idle
instead of spinning.

vLLM's ``MultiprocExecutor.collective_rpc`` reads each worker's reply from a shared-memory ring
(``shm_broadcast.MessageQueue``). Its reader spins (``SpinCondition.wait``: ``sched_yield`` in a loop) for
``busy_loop_s`` (1 s, fixed in vLLM 0.32) after its previous read, and only then sleeps on the writer's
zmq notification. That spin is right for ``execute_model``, whose replies come every few milliseconds. A
sync call takes hundreds of milliseconds of the workers' CPU, and one started within a second of the
engine's previous reply from its workers (the last decoding step, the previous sync) shares the cores with
that loop: measured on a 2-core CPU, 0.15-0.7 CPU-seconds of the engine core per sync
(docs/measurements/engine-spin-avx512-2026-12-04.txt).

``install`` (called by the ``vllm.general_plugins`` entry point in every vLLM process) wraps
``MultiprocExecutor.collective_rpc`` once: before a call of one of rollout-sync's worker methods, each
worker's reply queue is put straight into idle mode (its last read set to long ago), so the engine core
sleeps until the worker's reply notifies it (a zmq message, well under a millisecond). Nothing else
changes: every other call, and every call after the reply is read, spins as vLLM made it. Where vLLM's
internals are not as described (another version), nothing is wrapped and nothing changes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from .calls import PREFIX

__all__ = ["install", "is_quiet_call", "quiet_replies", "wrap"]

_MARK = "_rollout_sync_quiet_wait"


def is_quiet_call(method: object) -> bool:
    """Whether the engine core waits idle for ``method``'s replies: rollout-sync's worker calls (the
    extension's ``rollout_sync_*`` methods, every call of the driver goes through ``rollout_sync_call``)."""
    return isinstance(method, str) and method.startswith(PREFIX)


def quiet_replies(executor: Any) -> int:
    """Put each of ``executor``'s worker reply queues into idle mode for its next read; returns how many."""
    quiet = 0
    for queue in getattr(executor, "response_mqs", None) or ():
        condition = getattr(queue, "_spin_condition", None)
        if condition is not None and hasattr(condition, "last_read") and hasattr(condition, "busy_loop_s"):
            condition.last_read = -math.inf
            quiet += 1
    return quiet


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (an executor's ``collective_rpc``) with its reply queues quieted before a quiet call."""

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if is_quiet_call(method):
            quiet_replies(self)
        return original(self, method, *args, **kwargs)

    setattr(collective_rpc, _MARK, True)
    return collective_rpc


def install() -> bool:
    """Wrap ``MultiprocExecutor.collective_rpc`` (once per process); False where it cannot be found."""
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError:
        return False
    original = getattr(MultiprocExecutor, "collective_rpc", None)
    if original is None:
        return False
    if not getattr(original, _MARK, False):
        MultiprocExecutor.collective_rpc = wrap(original)  # type: ignore[method-assign]
    return True
