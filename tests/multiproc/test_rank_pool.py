"""The persistent rank pool used by end-to-end tests and the example."""

from __future__ import annotations

import os
import time

import pytest

from testbed.rank_pool import RankError, RankPool


def remember(ctx, value):
    ctx.state["value"] = value * (ctx.rank + 1)
    return os.environ["RANK"], os.environ["WORLD_SIZE"]


def recall(ctx):
    return ctx.state["value"]


def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one refuses")
    return "fine"


def sleep(ctx, seconds):
    time.sleep(seconds)


def test_ranks_keep_state_between_commands_and_see_their_rank_in_the_environment():
    with RankPool(2) as pool:
        assert pool.call(remember, 10) == [("0", "2"), ("1", "2")]
        assert pool.call(recall) == [10, 20]


def test_a_rank_error_comes_back_with_its_traceback():
    with RankPool(2) as pool, pytest.raises(RankError, match="rank 1: ValueError: rank one refuses"):
        pool.call(fail_on_rank_one)


def test_a_killed_rank_or_a_slow_one_makes_the_call_raise_instead_of_hanging():
    with RankPool(2) as pool:
        pending = pool.submit(sleep, 30)
        time.sleep(0.5)
        pool.kill_rank(1)
        start = time.monotonic()
        with pytest.raises(RankError, match=r"rank\(s\) \[0\] did not finish|rank 1 died"):
            pending.result(timeout=3)
        assert time.monotonic() - start < 10
