"""Reference storage contents computed from full logical tensors, through a map (for checks and tests).

``extract(full, tmap, rank)`` is what rank ``rank``'s storage must hold when the logical tensor is
``full``: every piece's box of ``full`` written at the piece's address. It is independent of the planner
and the executor, so it serves as the oracle that a sync landed every element in the right place.
"""

from __future__ import annotations

import torch

from rollout_sync.layout.combine import alone
from rollout_sync.layout.maps import TensorMap


def extract(full: torch.Tensor, tmap: TensorMap, rank: int, *, fill: float = float("nan")) -> torch.Tensor:
    """A new contiguous storage of rank ``rank`` (shape from the map) holding ``full``'s pieces."""
    if tuple(full.shape) != tmap.shape:
        raise ValueError(f"{tmap.name}: full tensor of shape {tuple(full.shape)}, the map says {tmap.shape}")
    storage = tmap.ranks[rank]
    out = (
        torch.full(storage.shape, fill, dtype=full.dtype)
        if full.is_floating_point()
        else torch.zeros(storage.shape, dtype=full.dtype)
    )
    for p in storage.pieces:
        region = full[tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))]
        torch.as_strided(out, p.box.extent, p.strides, p.offset).copy_(region)
    return out


def local_part(tmap: TensorMap, rank: int, local_rank: int) -> TensorMap:
    """The part of ``tmap`` that describes rank ``rank`` alone, renumbered to ``local_rank`` (what one
    vLLM worker describes before it knows its global rank)."""
    return alone(tmap, rank, local_rank)
