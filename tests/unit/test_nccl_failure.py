"""After a failed sync over NCCL no collective runs again over the group (its communicator may be aborted;
a collective over it hangs or crashes): the endpoint skips the failure commit, aborts the group and raises.
Over gloo the failure commit still tells the peers why. A fake group stands in for the backends (pure logic
of the endpoint; the real gloo path is tested in tests/multiproc)."""

from __future__ import annotations

import pytest
import torch
from planner_layouts import whole

from rollout_sync.errors import PeerFailedError
from rollout_sync.planning.planner import plan_model
from rollout_sync.sync.endpoint import Endpoint
from rollout_sync.transport import ExecuteOptions


class _FailingGroup:
    """A two-rank group whose every operation fails as an aborted communicator does."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.calls: list[str] = []

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2

    def name(self) -> str:
        return self.backend

    def _fail(self, what: str) -> None:
        self.calls.append(what)
        raise RuntimeError(f"{what}: NCCL communicator was aborted")

    def allgather(self, *args: object, **kwargs: object) -> None:
        self._fail("allgather")

    def send(self, *args: object, **kwargs: object) -> None:
        self._fail("send")

    def recv(self, *args: object, **kwargs: object) -> None:
        self._fail("recv")

    def abort(self) -> None:
        self.calls.append("abort")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.mark.parametrize(("backend", "device", "after"), [("nccl", "cuda", ["abort"]), ("gloo", "cpu", None)])
def test_a_failed_sync_runs_no_collective_over_an_nccl_group_afterwards(backend, device, after):
    plan = plan_model([whole("w", (8,), [0])], [whole("w", (8,), [1])])
    group = _FailingGroup(backend)
    endpoint = Endpoint(
        rank=0,
        world_size=2,
        trainer_ranks=1,
        group=group,
        half=plan.half(0),
        options=ExecuteOptions(timeout=5),
        device=device,
    )
    with pytest.raises((PeerFailedError, RuntimeError)):
        endpoint.run({"w": torch.ones(8)}, {}, version=3)
    assert group.calls[0] == "allgather"  # the agreement
    if after is not None:
        assert group.calls[1:] == after, group.calls  # no failure commit over the aborted communicator
    else:
        assert group.calls[1] == "allgather", group.calls  # gloo: the failure commit is attempted
        assert group.calls[-1] == "shutdown"
    assert endpoint.closed
