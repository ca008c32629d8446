"""Agreement before any byte moves: one allgather of a fixed-size record per rank, then the same decision
on every rank.

Each rank's record says which plan it holds (digest), whether its local checks passed (and why not), the
fingerprints of its half (``fingerprint.py``), its executor options, and the largest message it can stage
per peer. ``decide`` is a pure function of all records: every rank reaches the same verdict and, on any
mismatch, raises the same ``PlanMismatchError`` naming the ranks and the reason, so no rank is left
waiting for a peer that gave up.

Record layout (little endian, ``RECORD_BYTES`` bytes)::

    0   4  magic b"RSX" + format version
    4   4  group rank           8   4  half rank (-1: none)
    12  1  status (0 ready, 1 refused)      13  1  flags (bit 0 zero_copy, bit 1 overlap, bit 2 shared_memory)
    14  2  reason length        16  32 sha256 of the plan digest
    48  16 table hash           64  8  sum of sent segment hashes      72  8  sum of received ones
    80  8  wanted message bytes 88  8  staging cap bytes
    96  16 digest prefix (text) 112 8  base version (-1: none)   120 8  base layout
    128 ... reason (UTF-8, truncated)

The base (``delta``): the version of the last sync this rank committed with the delta option on, and the
layout of that sync's messages (``delta.layout_key``); ``delta_base`` decides whether this sync is a delta.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import PlanMismatchError
from ...planning.half import PlanHalf
from .collectives import allgather_bytes
from .fingerprint import MASK64
from .stats import ExecuteOptions

__all__ = [
    "FORMAT_VERSION",
    "RECORD_BYTES",
    "Record",
    "decide",
    "decode",
    "delta_base",
    "encode",
    "exchange",
    "record_of",
]

FORMAT_VERSION = 2
RECORD_BYTES = 512
_MAGIC = b"RSX" + bytes([FORMAT_VERSION])
_HEAD = struct.Struct("<4sIiBBH32s16sQQQQ16sq8s")
_REASON_BYTES = RECORD_BYTES - _HEAD.size  # 384


@dataclass(frozen=True, slots=True)
class Record:
    group_rank: int
    half_rank: int
    refused: bool
    zero_copy: bool
    overlap: bool
    digest_sha: bytes
    digest_prefix: str
    table_hash: bytes
    sent_sum: int
    received_sum: int
    message_bytes: int
    staging_cap_bytes: int
    reason: str
    shared_memory: bool = False
    base_version: int = -1
    base_layout: bytes = b"\0" * 8
    magic: bytes = _MAGIC


def encode(r: Record) -> bytes:
    reason = r.reason.encode("utf-8", "replace")[:_REASON_BYTES]
    reason = reason.decode("utf-8", "ignore").encode("utf-8")  # never cut a character in half
    head = _HEAD.pack(
        r.magic,
        r.group_rank,
        r.half_rank,
        int(r.refused),
        int(r.zero_copy) | int(r.overlap) << 1 | int(r.shared_memory) << 2,
        len(reason),
        r.digest_sha,
        r.table_hash,
        r.sent_sum & MASK64,
        r.received_sum & MASK64,
        r.message_bytes,
        r.staging_cap_bytes,
        r.digest_prefix.encode("utf-8", "replace")[:16],
        r.base_version,
        r.base_layout[:8].ljust(8, b"\0"),
    )
    return (head + reason).ljust(RECORD_BYTES, b"\0")


def decode(data: bytes) -> Record:
    if len(data) != RECORD_BYTES:
        raise ValueError(f"an agreement record has {RECORD_BYTES} bytes, not {len(data)}")
    (
        magic,
        grank,
        hrank,
        status,
        flags,
        nreason,
        dsha,
        thash,
        ssum,
        rsum,
        mbytes,
        cap,
        prefix,
        base,
        layout,
    ) = _HEAD.unpack(data[: _HEAD.size])
    reason = data[_HEAD.size : _HEAD.size + nreason].decode("utf-8", "replace")
    return Record(
        group_rank=grank,
        half_rank=hrank,
        refused=bool(status),
        zero_copy=bool(flags & 1),
        overlap=bool(flags & 2),
        shared_memory=bool(flags & 4),
        digest_sha=dsha,
        digest_prefix=prefix.rstrip(b"\0").decode("utf-8", "replace"),
        table_hash=thash,
        sent_sum=ssum,
        received_sum=rsum,
        message_bytes=mbytes,
        staging_cap_bytes=cap,
        reason=reason,
        base_version=base,
        base_layout=layout,
        magic=magic,
    )


def digest_sha(digest: str) -> bytes:
    return hashlib.sha256(digest.encode("utf-8")).digest()


def record_of(
    group_rank: int,
    half: Any,
    reason: str | None,
    fingerprints: tuple[bytes, tuple[int, int]] | None,
    message_bytes: int,
    options: ExecuteOptions,
    base: tuple[int, bytes] | None,
) -> Record:
    """The record of rank ``group_rank``: the half it was given (anything: a rank given no ``PlanHalf`` says
    so), its refusal ``reason``, its half's fingerprints (``fingerprint``; None: zeros), the message size it
    offers, its executor options and the delta base it names."""
    thash, (sent, received) = fingerprints if fingerprints is not None else (b"\0" * 16, (0, 0))
    digest = half.digest if isinstance(half, PlanHalf) else ""
    return Record(
        group_rank=group_rank,
        half_rank=half.rank if isinstance(half, PlanHalf) else -1,
        refused=reason is not None,
        zero_copy=options.zero_copy,
        overlap=options.overlap,
        shared_memory=options.shared_memory,
        digest_sha=digest_sha(digest),
        digest_prefix=digest[:16],
        table_hash=thash,
        sent_sum=sent,
        received_sum=received,
        message_bytes=message_bytes,
        staging_cap_bytes=options.staging_cap_bytes,
        reason=reason or "",
        base_version=-1 if base is None else base[0],
        base_layout=b"\0" * 8 if base is None else base[1],
    )


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _verb(ranks: Sequence[int], singular: str, plural: str) -> str:
    return f"{_ranks(ranks)} {singular if len(ranks) == 1 else plural}"


def _split_by(records: Sequence[Record], key: Any) -> list[list[int]]:
    """Ranks grouped by ``key(record)``; the largest group first (ties: the group of the lowest rank)."""
    groups: dict[Any, list[int]] = {}
    for rank, rec in enumerate(records):
        groups.setdefault(key(rec), []).append(rank)
    return sorted(groups.values(), key=lambda g: (-len(g), g[0]))


_PREFIX = "rollout-sync refused the sync before any byte moved: "


def decide(records: Sequence[Record]) -> list[int]:
    """Every rank's wanted message size, or ``PlanMismatchError`` (the same on every rank)."""
    bad = [r for r, rec in enumerate(records) if rec.magic != _MAGIC]
    if bad:
        found = records[bad[0]].magic
        raise PlanMismatchError(
            _PREFIX
            + f"{_verb(bad, 'speaks', 'speak')} transport format {found!r}, this rank speaks {_MAGIC!r}"
        )
    refusals = [(r, rec.reason) for r, rec in enumerate(records) if rec.refused]
    if refusals:
        raise PlanMismatchError(_PREFIX + "; ".join(f"rank {r}: {why}" for r, why in refusals))
    groups = _split_by(records, lambda rec: rec.digest_sha)
    if len(groups) > 1:
        described = ", ".join(
            f"{_verb(g, 'holds', 'hold')} plan digest {records[g[0]].digest_prefix or '(empty)'}..."
            for g in groups
        )
        raise PlanMismatchError(_PREFIX + f"ranks hold different plans: {described}")
    groups = _split_by(records, lambda rec: rec.table_hash)
    if len(groups) > 1:
        odd = sorted(r for g in groups[1:] for r in g)
        raise PlanMismatchError(
            _PREFIX + f"{_verb(odd, 'holds', 'hold')} a tensor table that differs from "
            f"that of {_ranks(groups[0])}, under the same plan digest"
        )
    groups = _split_by(records, lambda rec: (rec.zero_copy, rec.overlap, rec.shared_memory))
    if len(groups) > 1:
        described = ", ".join(
            f"{_ranks(g)} zero_copy={records[g[0]].zero_copy} overlap={records[g[0]].overlap} "
            f"shared_memory={records[g[0]].shared_memory}"
            for g in groups
        )
        raise PlanMismatchError(_PREFIX + f"ranks run the executor with different options: {described}")
    sent = sum(rec.sent_sum for rec in records) & MASK64
    received = sum(rec.received_sum for rec in records) & MASK64
    if sent != received:
        raise PlanMismatchError(
            _PREFIX + "the halves do not fit together: the segments sent are not the segments received, "
            "although every rank holds the same plan digest (a half was built wrongly)"
        )
    return [rec.message_bytes for rec in records]


def delta_base(records: Sequence[Record], layout: bytes) -> int | None:
    """The base version of a delta sync: the one every rank names, under the message layout agreed now;
    None (a full sync) when any rank names none, another version or another layout."""
    bases = {(rec.base_version, rec.base_layout) for rec in records}
    if len(bases) != 1:
        return None
    ((version, base_layout),) = bases
    return version if version >= 0 and base_layout == layout[:8].ljust(8, b"\0") else None


def exchange(
    group: Any, record: bytes, world: int, timeout: float, rank: int, device: Any = "cpu"
) -> list[Record]:
    """Allgather every rank's record over ``group`` (the group object's own API), bounded by ``timeout``.
    ``device`` is where the backend wants collective tensors (``cuda`` for NCCL)."""
    raw = allgather_bytes(
        group, record, world, timeout=timeout, rank=rank, what="the plan agreement", device=device
    )
    return [decode(r) for r in raw]
