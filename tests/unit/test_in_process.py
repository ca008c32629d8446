"""The in-process mailbox of handoffs (two ranks of one sync group in one process, each on its own thread)
and the integration's trainer refusals: pure logic, no process group."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from rollout_sync.errors import UnsupportedLayoutError
from rollout_sync.integrations.weight_sync import check_trainer
from rollout_sync.transport.core.in_process import InProcess

SHORT = timedelta(seconds=0.2)


def pair(group: str) -> tuple[InProcess, InProcess]:
    return InProcess(group, 0, frozenset({5})), InProcess(group, 5, frozenset({0}))


@pytest.mark.parametrize("offer_first", [True, False])
def test_the_receiver_takes_the_sender_s_storages_whichever_side_comes_first(offer_first):
    a, b = pair(f"g-order-{offer_first}")
    sources = {"w": torch.arange(4.0)}
    taken: dict[str, object] = {}

    def take() -> None:
        taken["sources"] = b.take(0, timedelta(seconds=5))
        b.finish(0)

    if offer_first:
        offered = a.offer(5, sources)
        take()
    else:
        t = threading.Thread(target=take)
        t.start()
        time.sleep(0.05)  # the take waits first
        offered = a.offer(5, sources)
        t.join(5)
    assert taken["sources"] is sources
    assert offered.wait(SHORT)


def test_the_sender_waits_until_the_receiver_finishes_and_learns_its_error():
    a, b = pair("g-finish")
    offered = a.offer(5, {"w": torch.zeros(2)})
    b.take(0, SHORT)
    with pytest.raises(RuntimeError, match="timed out"):  # not finished yet
        offered.wait(SHORT)
    b.finish(0, "copying failed: boom")
    with pytest.raises(RuntimeError, match="boom"):
        offered.wait(SHORT)


@pytest.mark.parametrize("offer_first", [True, False])
def test_a_declined_offer_fails_at_once(offer_first):
    a, b = pair(f"g-decline-{offer_first}")
    if offer_first:
        offered = a.offer(5, {})
        b.decline(0, "rank 5 failed first")
    else:
        b.decline(0, "rank 5 failed first")
        offered = a.offer(5, {})
    with pytest.raises(RuntimeError, match="rank 5 failed first"):
        offered.wait(SHORT)


def test_a_take_without_an_offer_times_out_and_leaves_nothing_behind():
    a, b = pair("g-timeout")
    with pytest.raises(RuntimeError, match="timed out"):
        b.take(0, SHORT)
    offered = a.offer(5, {})  # a later offer is not matched with the abandoned take
    with pytest.raises(RuntimeError, match="timed out"):
        offered.wait(SHORT)


def test_a_rank_that_leaves_fails_its_peer_at_once():
    a, b = pair("g-leave")
    errors: list[str] = []

    def take() -> None:
        try:
            b.take(0, timedelta(seconds=30))
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=take)
    t.start()
    time.sleep(0.05)
    a.leave("its sync failed")
    t.join(5)
    assert not t.is_alive() and errors and "rank 0 left" in errors[0]
    with pytest.raises(RuntimeError, match="rank 0 left"):  # and a later take fails without waiting
        b.take(0, SHORT)


def test_groups_are_separate():
    a, _ = pair("g-one")
    _, b2 = pair("g-two")
    a.offer(5, {})
    with pytest.raises(RuntimeError, match="timed out"):
        b2.take(0, SHORT)


class _Engine:
    def zero_optimization_stage(self) -> int:
        return 3


def test_trainer_refusals_name_what_was_found():
    check_trainer(_Engine(), distributed_type="DistributedType.DEEPSPEED")
    with pytest.raises(UnsupportedLayoutError, match="FSDP"):
        check_trainer(None, distributed_type="DistributedType.FSDP")
    with pytest.raises(UnsupportedLayoutError, match="found Module"):
        check_trainer(torch.nn.Module(), distributed_type="DEEPSPEED")
