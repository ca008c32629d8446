"""Copies within one process: a rank's local segments, and handoffs between ranks of one process
(``in_process``), where the receiver copies each segment straight from the source storages its in-process
peer hands over."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..planning.plan import PlanHalf, Segment
from .p2p import Transport
from .targets import Targets

__all__ = ["copy_handoff", "copy_segments"]


def copy_segments(
    segments: Iterable[Segment], half: PlanHalf, sources: Mapping[str, torch.Tensor], targets: Targets
) -> None:
    """Copy each segment from its source storage into its target storage (cast to the target's dtype)."""
    for s in segments:
        name = half.tensors[s.tensor].name
        src, dst = sources[name], targets.get(name)
        torch.as_strided(dst, s.extent, s.target_strides, dst.storage_offset() + s.target_offset).copy_(
            torch.as_strided(src, s.extent, s.source_strides, src.storage_offset() + s.source_offset)
        )
        targets.landed(name)


def copy_handoff(
    transport: Transport, peer: int, segments: tuple[Segment, ...], half: PlanHalf, targets: Targets
) -> None:
    """Copy ``segments`` straight from the source storages ``peer`` (in this process) hands over."""
    sources = transport.take(peer)
    try:
        copy_segments(segments, half, sources, targets)
    except BaseException as e:
        transport.finish(peer, f"rank {transport.rank} failed copying from rank {peer}'s storages: {e!r}")
        raise
    transport.finish(peer)
