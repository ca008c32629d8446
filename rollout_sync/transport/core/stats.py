"""Options of the executor, the statistics one sync returns, and the clock of its phases."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_STAGING_CAP_BYTES", "ExecuteOptions", "PhaseClock", "SyncStats"]

DEFAULT_STAGING_CAP_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ExecuteOptions:
    staging_cap_bytes: int = DEFAULT_STAGING_CAP_BYTES
    """Bytes of pack and unpack buffers this rank may hold at once (all peers, both directions)."""
    timeout: float = 300.0
    """Seconds any single wait (the agreement, one message) may take before the sync fails: a peer that
    dies or stalls becomes an error within this time on every rank waiting for it."""
    overlap: bool = True
    """Pack the next round while the current one is on the wire (two slots per peer and direction)."""
    zero_copy: bool = True
    """Send dense same-dtype segments straight from source storage into target storage, unstaged."""
    shared_memory: bool = True
    """Between ranks on one host in different processes (CPU, gloo), pull or stage bytes through memory
    (``shared_memory``, ``cross_memory``) and send only signals over the group; off: every byte goes over
    the group. Every rank must run the same way (agreed per sync; a handshake sets it for all)."""
    map_sources: bool = True
    """With ``shared_memory``: where a same-host peer can map this process's memory, move the source storages
    this rank sends from into shared memory in place (once; every view of them keeps working) and let the
    receiver copy its segments straight from them (``mapped``: no messages, one copy). Off: pulls and shared
    slots only. Each pair maps only where both ends have it on."""
    delta: bool = False
    """Delta syncs (``delta``): after a sync every rank has committed, the next one sends only the elements
    that changed. A sender keeps a copy of what it sent (its shadow: the bytes it sends per sync). A rank
    with it off names no base, so every sync is a full one."""
    delta_full_above: float = 1 / 32
    """A sender whose sample of what it sends shows more than this share changed asks for a full sync (nearly
    every message would travel whole: the default is ``delta.FALLBACK_SHARE``). 1.0: never."""

    def __post_init__(self) -> None:
        if self.staging_cap_bytes <= 0:
            raise ValueError(f"staging_cap_bytes must be positive, not {self.staging_cap_bytes}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, not {self.timeout}")
        if not 0 <= self.delta_full_above <= 1:
            raise ValueError(f"delta_full_above is a share in [0, 1], not {self.delta_full_above}")


@dataclass(frozen=True, slots=True)
class SyncStats:
    """What one rank did in one sync. Byte counts are payload bytes on the wire (``messages.wire_dtype``);
    ``bytes_handed``: per peer in this process, the bytes (in the target's dtype) that peer copied straight
    from this rank's sources (handoffs, no message); ``bytes_mapped`` the same for same-host peers in other
    processes that map this rank's storages; ``local_bytes`` counts this rank's copies within
    itself and from peers in its process."""

    rank: int
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    local_bytes: int
    messages_sent: int
    messages_received: int
    rounds: int
    peak_staging_bytes: int
    staging_cap_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_handed: dict[int, int] = field(default_factory=dict)
    bytes_mapped: dict[int, int] = field(default_factory=dict)
    """Per same-host peer in another process that maps this rank's storages (``mapped``), the bytes (in the
    target's dtype) it copied straight from them (no message)."""
    bytes_mapped_from: dict[int, int] = field(default_factory=dict)
    """Per same-host peer whose storages this rank maps, the bytes (in the target's dtype) it copied from them."""
    bytes_pulled: dict[int, int] = field(default_factory=dict)
    """Of ``bytes_received``, per same-host peer, the bytes this rank pulled straight from its memory."""
    delta_base: int | None = None
    """The base version a delta sync applied its changes on; None for a full sync."""
    elements_compared: int = 0
    """A sender in a delta sync: the elements it compared with what it last sent."""
    elements_changed: int = 0
    """Of ``elements_compared``, those that had changed (bit for bit, in the dtype the receiver holds)."""
    unchanged_targets: frozenset[str] = frozenset()
    """A receiver in a delta sync: the targets no element of which changed (every message to them came
    without a change): their storages hold what they held before the sync. Empty in a full sync."""
    delta_state_bytes: int = 0
    """The memory this rank keeps for delta syncs (a sender's shadow of what it last sent)."""
    estimated_changed_share: float | None = None
    """A sender with delta syncs on: the share of its sample that changed since the last sync (above
    ``delta.FALLBACK_SHARE`` it asked for a full sync)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "bytes_sent": {str(k): v for k, v in self.bytes_sent.items()},
            "bytes_received": {str(k): v for k, v in self.bytes_received.items()},
            "local_bytes": self.local_bytes,
            "messages_sent": self.messages_sent,
            "messages_received": self.messages_received,
            "rounds": self.rounds,
            "peak_staging_bytes": self.peak_staging_bytes,
            "staging_cap_bytes": self.staging_cap_bytes,
            "seconds": dict(self.seconds),
            "bytes_handed": {str(k): v for k, v in self.bytes_handed.items()},
            "bytes_mapped": {str(k): v for k, v in self.bytes_mapped.items()},
            "bytes_mapped_from": {str(k): v for k, v in self.bytes_mapped_from.items()},
            "bytes_pulled": {str(k): v for k, v in self.bytes_pulled.items()},
            "delta_base": self.delta_base,
            "elements_compared": self.elements_compared,
            "elements_changed": self.elements_changed,
            "unchanged_targets": len(self.unchanged_targets),
            "delta_state_bytes": self.delta_state_bytes,
            "estimated_changed_share": self.estimated_changed_share,
        }


class PhaseClock:
    """Seconds by phase of one sync (``SyncStats.seconds``): ``add(phase, since)`` adds the time since
    ``since`` to ``phase`` and returns now, the start of the next phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
        return now
