"""Two spawned ranks reach each other over gloo through the shared rank runner."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.harness.ranks import run_on_ranks  # noqa: E402


def _all_reduce_rank_number(rank: int, world_size: int, group) -> list[float]:
    import torch.distributed as dist

    tensor = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    group.allreduce([tensor], opts).wait()
    return tensor.tolist()


def test_a_two_rank_gloo_all_reduce_sums_every_rank_contribution():
    results = run_on_ranks(_all_reduce_rank_number, 2, timeout=120)
    assert results == [[3.0, 30.0], [3.0, 30.0]]
