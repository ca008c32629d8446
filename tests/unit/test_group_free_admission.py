"""What the coordinator refuses for a group-free sync (backend ``nixl``), before anything moves: delta syncs
with a trainer rank that has no export, two ranks in one process, a trainer rank that started no NIXL agent;
and what it tells the workers."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_sync.errors import HandshakeError
from rollout_sync.handshake import ROLLOUT, TRAINER, PeerInfo
from rollout_sync.sync.fleet_plan import check_group_free, entry_of


def _peer(role: str, local_rank: int, pid: int, **fields: Any) -> PeerInfo:
    base = {"host": "h", "pid": pid, "machine": "m", "bind": "10.0.0.1"}
    return PeerInfo(b"%d" % pid, role, 0, local_rank, 2, {**base, **fields}, b"")


def _agent(n: int) -> dict[str, Any]:
    return {"agent": f"a{n}", "metadata": "00ff", "bases": {"w": 4096}, "state": 8192}


def test_the_workers_are_told_each_trainer_rank_s_agent_by_global_rank():
    peers = [
        _peer(TRAINER, 0, 10, nixl=_agent(0)),
        _peer(TRAINER, 1, 11, nixl=_agent(1)),
        _peer(ROLLOUT, 0, 20),
    ]
    roster = [entry_of(p, r) for r, p in enumerate(peers)]
    assert check_group_free(roster, peers, delta=False) == {"0": _agent(0), "1": _agent(1)}


def test_delta_without_an_export_two_ranks_in_one_process_and_a_trainer_rank_without_an_agent_are_refused():
    peers = [_peer(TRAINER, 0, 10, nixl=_agent(0)), _peer(ROLLOUT, 0, 20)]
    roster = [entry_of(p, r) for r, p in enumerate(peers)]
    with pytest.raises(HandshakeError, match="trainer rank 0 on h has no delta export"):
        check_group_free(roster, peers, delta=True)
    exporting = {**_agent(0), "export": 1 << 20, "export_bytes": 4096, "message_bytes": 1024}
    peers = [_peer(TRAINER, 0, 10, nixl=exporting), _peer(ROLLOUT, 0, 20)]
    assert check_group_free(roster, peers, delta=True) == {"0": exporting}
    shared = [_peer(TRAINER, 0, 10, nixl=_agent(0)), _peer(ROLLOUT, 0, 10)]
    with pytest.raises(HandshakeError, match="run in one process"):
        check_group_free([entry_of(p, r) for r, p in enumerate(shared)], shared, delta=False)
    bare = [_peer(TRAINER, 0, 10), _peer(ROLLOUT, 0, 20)]
    with pytest.raises(HandshakeError, match="trainer rank 0 on h did not start a NIXL agent"):
        check_group_free([entry_of(p, r) for r, p in enumerate(bare)], bare, delta=False)
