"""Every rollout-sync call to an engine's workers, offline or served, with its own nonce.

vLLM's ``collective_rpc`` (``MultiprocExecutor``) reads one reply per worker in worker order and raises at
the first failed one, leaving the other workers' replies queued: at TP > 1 every later call then receives
its predecessor's answer. Nothing a driver does through ``collective_rpc`` can read a queued reply without
a new one being queued behind it, so the misalignment cannot be drained once it exists; it must not arise.
Every call therefore goes through the worker extension's ``rollout_sync_call``, which runs the method and
*answers* ``{"nonce", "result"}`` or ``{"nonce", "error"}`` instead of raising: every worker replies
normally, every reply is read, and the next call gets its own answers. Each answer must carry the call's
fresh nonce; one that does not (a reply left queued by a failed call made outside this module) is refused
with ``StaleAnswerError`` naming the engine and worker, and a worker's error becomes ``PeerFailedError``
naming them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_sync.errors import PeerFailedError, StaleAnswerError

__all__ = ["PREFIX", "call", "call_request", "check_answers"]

PREFIX = "rollout_sync_"


def call_request(
    method: str, nonce: str, kwargs: Mapping[str, Any] | None, args: Sequence[Any]
) -> dict[str, Any]:
    """The kwargs of ``rollout_sync_call`` for ``rollout_sync_<method>(*args, **kwargs)``."""
    return {"method": method, "nonce": nonce, "kwargs": dict(kwargs or {}), "args": list(args)}


def check_answers(engine: str, method: str, nonce: str, answers: Any) -> list[Any]:
    """The per-worker results of one ``rollout_sync_call``; raises ``StaleAnswerError`` when an answer is
    missing or carries another call's nonce, ``PeerFailedError`` when a worker reports an error."""
    if not isinstance(answers, list) or not answers:
        raise PeerFailedError(f"engine {engine}: {method}: expected one answer per worker, got {answers!r}")
    errors = []
    results = []
    for worker, answer in enumerate(answers):
        if not isinstance(answer, dict) or answer.get("nonce") != nonce:
            found = answer.get("nonce") if isinstance(answer, dict) else answer
            raise StaleAnswerError(
                f"engine {engine} worker {worker}: {method}: stale answer, it belongs to another call "
                f"(expected nonce {nonce}, found {str(found)[:200]!r}); a call made outside rollout-sync's "
                "driver failed at TP > 1 and left its replies queued: restart this engine"
            )
        if "error" in answer:
            errors.append(f"engine {engine} worker {worker}: {method} failed: {answer['error']}")
        results.append(answer.get("result"))
    if errors:
        raise PeerFailedError("; ".join(errors))
    return results


def call(
    engine: Any,
    method: str,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> list[Any]:
    """``rollout_sync_<method>`` (``method`` with or without the prefix) on every worker of ``engine``, one
    result per worker. ``engine``: a ``vllm.LLM`` (or anything with its ``collective_rpc``), or an engine
    with its own nonce-checked ``call`` (``http_driver.ServerEngine``)."""
    from .http_driver import ServerEngine

    short = method.removeprefix(PREFIX)
    if isinstance(engine, ServerEngine):
        return list(engine.call(short, kwargs, args))
    nonce = uuid.uuid4().hex
    answers = engine.collective_rpc("rollout_sync_call", kwargs=call_request(short, nonce, kwargs, args))
    return check_answers(name if name is not None else type(engine).__name__, short, nonce, list(answers))
