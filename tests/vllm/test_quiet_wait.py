"""The engine core waits idle, not spinning, for its workers' replies to rollout-sync's calls
(``vllm_plugin.quiet_wait``), on vLLM's own reply-queue wait (``shm_broadcast.SpinCondition``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_plugin import quiet_wait

pytestmark = pytest.mark.vllm


def _condition(address: str) -> tuple[Any, Any, Any]:
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    context = zmq.Context()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    return context, writer, reader


def test_a_quiet_reply_queue_sleeps_until_notified() -> None:
    context, writer, reader = _condition("inproc://rollout-sync-quiet-wait")
    try:
        time.sleep(0.05)  # the subscription reaches the publisher
        reader.record_read()  # a reply was just read: vLLM spins on the next wait
        start = time.perf_counter()
        reader.wait(timeout_ms=3000)  # one sched_yield, not a sleep until the timeout
        assert time.perf_counter() - start < 1.5, "right after a read vLLM's wait returns at once (spin)"

        executor = SimpleNamespace(response_mqs=[SimpleNamespace(_spin_condition=reader)])
        assert quiet_wait.quiet_replies(executor) == 1
        start = time.perf_counter()
        reader.wait(timeout_ms=300)  # idle mode: sleeps on the writer's notification, here none
        assert time.perf_counter() - start >= 0.25

        quiet_wait.quiet_replies(executor)
        timer = threading.Timer(0.05, writer.notify)
        timer.start()
        start = time.perf_counter()
        reader.wait(timeout_ms=5000)  # woken by the notification, not by the timeout
        took = time.perf_counter() - start
        timer.join()
        assert 0.03 <= took < 4.0
    finally:
        context.destroy(linger=0)


def test_only_rollout_sync_calls_are_quieted() -> None:
    calls: list[Any] = []
    condition = SimpleNamespace(last_read=123.0, busy_loop_s=1.0)
    executor = SimpleNamespace(response_mqs=[SimpleNamespace(_spin_condition=condition)])

    def original(self: Any, method: Any, *args: Any, **kwargs: Any) -> str:
        calls.append((method, condition.last_read))
        return "answer"

    wrapped = quiet_wait.wrap(original)
    assert wrapped(executor, "execute_model") == "answer"
    assert calls[-1] == ("execute_model", 123.0)  # vLLM's own calls spin as vLLM made them
    assert wrapped(executor, print) == "answer"  # a callable sent to the workers: not ours
    assert calls[-1][1] == 123.0
    assert wrapped(executor, "openrlhf_baseline_receive", args=(1,)) == "answer"
    assert calls[-1][1] == 123.0
    assert wrapped(executor, "rollout_sync_call", kwargs={"method": "receive"}) == "answer"
    assert calls[-1] == ("rollout_sync_call", float("-inf"))


def test_install_wraps_vllms_executor_once() -> None:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    assert quiet_wait.install()
    first = MultiprocExecutor.collective_rpc
    assert quiet_wait.install()
    assert MultiprocExecutor.collective_rpc is first
    assert getattr(first, "_rollout_sync_quiet_wait", False)
