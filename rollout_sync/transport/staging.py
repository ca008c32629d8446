"""The staging arena: one byte buffer per rank, carved into the schedule's pack and unpack slots, allocated
once and reused by every later sync (it grows only when a schedule needs more, and shrinks only when the
cap drops below what it holds)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StagingArena"]


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
