"""Small fixed-size collectives over a group object, every wait bounded: the plan agreement before a sync
and the commit after it both allgather one record per rank this way."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ...errors import PeerFailedError, SyncTimeoutError

__all__ = ["allgather_bytes"]


def allgather_bytes(
    group: Any, record: bytes, world: int, *, timeout: float, rank: int, what: str, device: Any = "cpu"
) -> list[bytes]:
    """Every rank's ``record`` (all the same length), in group-rank order, over ``group``'s own allgather.
    ``what`` names the step in errors ("the plan agreement", "the sync's commit"); ``device`` is where the
    backend wants collective tensors (``cuda`` for NCCL)."""
    import torch

    mine = torch.frombuffer(bytearray(record), dtype=torch.uint8).to(device)
    out = [torch.empty(len(record), dtype=torch.uint8, device=device) for _ in range(world)]
    try:
        work = group.allgather([out], [mine])
        finished = work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        text = str(e)
        if "imed out" in text or "imeout" in text:
            raise SyncTimeoutError(
                f"rank {rank}: {what} did not complete within {timeout:g} s "
                f"(a rank of the group did not join the sync, or stalled): {text}"
            ) from e
        raise PeerFailedError(f"rank {rank}: {what} failed (a peer died or left): {text}") from e
    if finished is False:
        raise SyncTimeoutError(f"rank {rank}: {what} did not complete within {timeout:g} s")
    return [bytes(t.cpu().numpy().tobytes()) for t in out]
