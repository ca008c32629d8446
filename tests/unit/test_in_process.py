"""The in-process mailbox (two ranks of one sync group in one process, each on its own thread) and the
integration's trainer refusals: pure logic, no process group."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from rollout_sync.errors import UnsupportedLayoutError
from rollout_sync.integrations.weight_sync import check_trainer
from rollout_sync.transport.in_process import InProcess

SHORT = timedelta(seconds=0.2)


def pair(group: str) -> tuple[InProcess, InProcess]:
    return InProcess(group, 0, frozenset({5})), InProcess(group, 5, frozenset({0}))


@pytest.mark.parametrize("send_first", [True, False])
def test_message_is_copied_whichever_side_posts_first(send_first):
    a, b = pair(f"g-order-{send_first}")
    src = torch.arange(12, dtype=torch.uint8)
    dst = torch.zeros(12, dtype=torch.uint8)
    if send_first:
        sent = a.post("send", src, 5, tag=3)
        got = b.post("recv", dst, 0, tag=3)
    else:
        got = b.post("recv", dst, 0, tag=3)
        sent = a.post("send", src, 5, tag=3)
    assert sent.wait(SHORT) and got.wait(SHORT)
    assert torch.equal(dst, src)


def test_messages_match_by_tag_and_in_order():
    a, b = pair("g-tags")
    outs = [torch.zeros(4, dtype=torch.float32) for _ in range(3)]
    works = [
        b.post("recv", outs[0], 0, tag=1),
        b.post("recv", outs[1], 0, tag=2),
        b.post("recv", outs[2], 0, tag=1),
    ]
    a.post("send", torch.full((4,), 2.0), 5, tag=2)
    a.post("send", torch.full((4,), 1.0), 5, tag=1)
    a.post("send", torch.full((4,), 3.0), 5, tag=1)
    for w in works:
        w.wait(SHORT)
    assert [float(o[0]) for o in outs] == [1.0, 2.0, 3.0]


def test_views_of_another_dtype_receive_the_bytes():
    a, b = pair("g-bytes")
    src = torch.tensor([1.5, -2.0], dtype=torch.float32)
    dst = torch.zeros(8, dtype=torch.uint8)
    b.post("recv", dst, 0, tag=0)
    a.post("send", src, 5, tag=0).wait(SHORT)
    assert torch.equal(dst.view(torch.float32), src)


def test_size_mismatch_fails_both_ends():
    a, b = pair("g-size")
    got = b.post("recv", torch.zeros(3, dtype=torch.uint8), 0, tag=0)
    sent = a.post("send", torch.zeros(4, dtype=torch.uint8), 5, tag=0)
    for w in (got, sent):
        with pytest.raises(RuntimeError, match="sizes differ"):
            w.wait(SHORT)


def test_unmatched_message_times_out():
    _, b = pair("g-timeout")
    with pytest.raises(RuntimeError, match="timed out"):
        b.post("recv", torch.zeros(2), 0, tag=0).wait(SHORT)


def test_a_rank_that_leaves_fails_its_peer_at_once():
    a, b = pair("g-leave")
    waiting = b.post("recv", torch.zeros(2), 0, tag=0)
    errors: list[str] = []

    def wait() -> None:
        try:
            waiting.wait(timedelta(seconds=30))
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=wait)
    t.start()
    a.leave("its sync failed")
    t.join(5)
    assert not t.is_alive() and errors and "rank 0 left" in errors[0]
    with pytest.raises(RuntimeError, match="rank 0 left"):  # and a later post fails without waiting
        b.post("recv", torch.zeros(2), 0, tag=1).wait(SHORT)


def test_groups_are_separate():
    a, _ = pair("g-one")
    _, b2 = pair("g-two")
    a.post("send", torch.ones(2), 5, tag=0)
    with pytest.raises(RuntimeError, match="timed out"):
        b2.post("recv", torch.zeros(2), 0, tag=0).wait(SHORT)


class _Engine:
    def zero_optimization_stage(self) -> int:
        return 3


def test_trainer_refusals_name_what_was_found():
    check_trainer(_Engine(), distributed_type="DistributedType.DEEPSPEED")
    with pytest.raises(UnsupportedLayoutError, match="PEFT"):
        check_trainer(_Engine(), distributed_type="DEEPSPEED", peft=True)
    with pytest.raises(UnsupportedLayoutError, match="FSDP"):
        check_trainer(None, distributed_type="DistributedType.FSDP")
    with pytest.raises(UnsupportedLayoutError, match="found Module"):
        check_trainer(torch.nn.Module(), distributed_type="DEEPSPEED")
