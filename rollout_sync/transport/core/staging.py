"""The staging arena: one byte buffer per rank, carved into the schedule's pack and unpack slots, allocated
once and reused by every later sync (it grows only when a schedule needs more, and shrinks only when the
cap drops below what it holds)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .target_streams import TargetStream

__all__ = ["StagingArena", "slots_room"]


def slots_room(cap_bytes: int, targets: Mapping[str, torch.Tensor], stream: TargetStream | None) -> int:
    """The part of the staging cap a rank's pack and unpack slots may take. Streamed targets (loaded forms
    of layers vLLM keeps in another form, given as meta tensors) share the cap with the slots: room is left
    for what the stream holds with one of them made and for what closing it may allocate
    (``TargetStream.room_bytes``). Where that leaves the slots too little, the caller offers from the whole
    cap and the stream comes on top of it."""
    if stream is None or not any(isinstance(t, torch.Tensor) and t.is_meta for t in targets.values()):
        return cap_bytes
    return max(cap_bytes - stream.room_bytes(), 0)


class StagingArena:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.allocations = 0

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.numel())

    def reserve(self, nbytes: int, device: Any, cap_bytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` on ``device``, reused when the current one fits (and is within
        ``cap_bytes``)."""
        device = torch.device(device)
        buf = self._buffer
        if (
            buf is None
            or buf.device != device
            or buf.numel() < nbytes
            or buf.numel() > max(cap_bytes, nbytes)
        ):
            self._buffer = None  # release before allocating the new one
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None
            self._buffer = buf
            self.allocations += int(buf is not None)
        if buf is None:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return buf

    def release(self) -> None:
        self._buffer = None
