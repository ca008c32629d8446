"""The commit after a sync's transfer: every rank says whether its half completed, and which weight version
it sent; every rank reaches the same verdict.

One allgather of a fixed-size record per rank (the group object's own API, bounded by a timeout). The
rollout side claims the version the trainer ranks agree on, and only when every rank completed: a failed
or interrupted sync never passes silently.

Record (little endian, ``RECORD_BYTES``): magic ``b"RSC1"``, version (int64, -1 from rollout ranks), ok
(uint8), reason length (uint16), reason (UTF-8, truncated).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ..errors import PeerFailedError
from ..transport.core.collectives import allgather_bytes

RECORD_BYTES = 256
_MAGIC = b"RSC1"
_HEAD = struct.Struct("<4sqBH")


@dataclass(frozen=True)
class Verdict:
    version: int  # the weight version the trainer ranks sent
    ok: bool


def encode(version: int, ok: bool, reason: str) -> bytes:
    raw = reason.encode()[: RECORD_BYTES - _HEAD.size]
    return (_HEAD.pack(_MAGIC, version, int(ok), len(raw)) + raw).ljust(RECORD_BYTES, b"\0")


def decode(data: bytes) -> tuple[int, bool, str]:
    magic, version, ok, n = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise PeerFailedError(f"a peer sent a commit record in another format ({magic!r})")
    return version, bool(ok), data[_HEAD.size : _HEAD.size + n].decode(errors="replace")


def decide(records: list[tuple[int, bool, str]], trainer_ranks: int) -> int:
    """The agreed version; raises PeerFailedError naming every rank that failed, or trainer ranks that
    disagree about the version."""
    failed = [(r, reason) for r, (_, ok, reason) in enumerate(records) if not ok]
    if failed:
        named = "; ".join(f"rank {r}: {reason}" for r, reason in failed)
        raise PeerFailedError(f"the sync failed on {len(failed)} rank(s): {named}")
    versions = {records[r][0] for r in range(trainer_ranks)}
    if len(versions) != 1:
        raise PeerFailedError(f"trainer ranks disagree about the weight version: {sorted(versions)}")
    return versions.pop()


def commit(
    group: Any,
    *,
    rank: int,
    world: int,
    trainer_ranks: int,
    version: int,
    ok: bool,
    reason: str = "",
    timeout: float,
    device: Any = "cpu",
) -> int:
    """Allgather this rank's outcome and return the agreed version (raises on any failure, on every rank)."""
    raw = allgather_bytes(
        group,
        encode(version, ok, reason),
        world,
        timeout=timeout,
        rank=rank,
        what="the sync's commit",
        device=device,
    )
    return decide([decode(r) for r in raw], trainer_ranks)
