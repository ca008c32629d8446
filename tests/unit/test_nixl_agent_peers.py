"""``NixlAgent.add_peer``: NIXL's connection to a peer that cannot be reached yet (UCX's "Destination is
unreachable" right after a cut link came back) is tried again for a bounded time, then a typed error names
the peer. The NIXL agent is a stand-in here (pure logic: when to try again, what to raise)."""

from __future__ import annotations

import time

import pytest

from rollout_sync.errors import PeerFailedError
from rollout_sync.transport.nixl.agent import NixlAgent


class _Unreachable(Exception):
    pass


class _Agent:
    """Raises as NIXL does for the first ``fails`` calls, then returns the peer's name."""

    def __init__(self, fails: int) -> None:
        self.fails, self.calls = fails, 0

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls += 1
        if self.calls <= self.fails:
            raise _Unreachable("NIXL_ERR_BACKEND")
        return b"peer-agent"


def _agent(fails: int) -> NixlAgent:
    agent = object.__new__(NixlAgent)
    agent.agent = _Agent(fails)
    agent.peers = {}
    return agent


def test_a_peer_reachable_after_a_few_tries_is_added() -> None:
    agent = _agent(fails=2)
    assert agent.add_peer(b"md", "trainer rank 0 on host-a (10.0.0.1)", within=5.0) == "peer-agent"
    assert agent.agent.calls == 3 and agent.label("peer-agent") == "trainer rank 0 on host-a (10.0.0.1)"


def test_a_peer_never_reachable_is_named_in_a_typed_error_in_bounded_time() -> None:
    agent = _agent(fails=10**9)
    started = time.monotonic()
    with pytest.raises(
        PeerFailedError, match=r"trainer rank 1 on host-a \(10.0.0.1\): NIXL could not connect"
    ):
        agent.add_peer(b"md", "trainer rank 1 on host-a (10.0.0.1)", within=0.5)
    assert time.monotonic() - started < 3.0
    assert agent.peers == {}
