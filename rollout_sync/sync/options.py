"""The options of a sync, with one set of defaults for every entry point.

``TrainerSync.attach`` and ``connect``, ``WeightSync``, ``use_rollout_sync``, ``attach_in_ray``, vLLM's
trainer-side engine and the coordinator all take a ``SyncOptions`` (or its fields as keywords) and nothing
else declares these defaults. Trainer rank 0's options decide for the whole group (the coordinator tells
every rank at the handshake); a vLLM worker's own wait and staging cap are its ``connect`` arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..planning.policy import ReplicaPolicy
from ..transport import DEFAULT_STAGING_CAP_BYTES, ExecuteOptions

__all__ = ["SyncOptions"]

BACKENDS = ("gloo", "nccl", "nixl")


@dataclass(frozen=True)
class SyncOptions:
    timeout: float = 120.0
    """Seconds any single wait may take (the handshake, the agreement, one message) before the sync fails on
    every rank, naming the peers it waited for."""
    staging_cap_bytes: int = DEFAULT_STAGING_CAP_BYTES
    """Bytes of staging a rank may hold at once (pack and unpack buffers, all peers, both directions)."""
    shared_memory: bool = True
    """Ranks on one host in other processes move bytes through shared memory instead of the group (CPU)."""
    delta: bool = False
    """After a sync every rank committed, send only the elements that changed (``transport.delta``)."""
    backend: str = "gloo"
    """``gloo`` (CPU; CUDA storages on one host through CUDA IPC), ``nccl`` (GPUs) or ``nixl`` (no group:
    workers read their half)."""
    policy: ReplicaPolicy = "balanced"
    """Which holder of a replicated box sends it: ``balanced`` (spread, nearest first) or ``lowest``."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"SyncOptions.timeout must be positive, found {self.timeout!r}")
        if self.staging_cap_bytes <= 0:
            raise ValueError(
                f"SyncOptions.staging_cap_bytes must be positive, found {self.staging_cap_bytes!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"SyncOptions.backend must be one of {BACKENDS}, found {self.backend!r}")

    @classmethod
    def of(cls, options: SyncOptions | None = None, **overrides: Any) -> SyncOptions:
        """``options`` (the defaults if None) with ``overrides`` (field names) replaced; an unknown name is a
        ``TypeError`` naming it and the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown sync option(s) {unknown}: SyncOptions has {sorted(known)}")
        return replace(options if options is not None else cls(), **overrides)

    def execute_options(self) -> ExecuteOptions:
        return ExecuteOptions(staging_cap_bytes=self.staging_cap_bytes, timeout=self.timeout)
