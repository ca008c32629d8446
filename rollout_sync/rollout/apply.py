"""Writing received elements into a rollout worker's storage, in place: where a storage view sits in its
parameter, the elements of a piece or a segment inside it, and the ranges of a parameter no storage covers.

No vLLM import: storages are plain tensors (views of the engine's parameters, located by ``StorageView``),
pieces and segments are ``torch.as_strided`` addresses. An update as a whole (what is written when, what
is rebuilt from it) is ``rollout.update.UpdateSession``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..errors import OutOfBoundsError, UnsupportedLayoutError
from ..layout.maps import Piece, RankStorage
from .storage_view import StorageView

__all__ = [
    "covered_ranges",
    "piece_view",
    "storage_tensor",
    "torch_dtype",
    "uncovered_ranges",
    "write_pieces",
    "write_segment",
]


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def storage_tensor(param: torch.Tensor, view: StorageView, *, tensor: str, rank: int) -> torch.Tensor:
    """The storage ``view`` inside ``param`` (the parameter's real data): a contiguous view, no copy."""
    if not param.is_contiguous():
        raise UnsupportedLayoutError(
            "a storage view needs a contiguous parameter",
            tensor=tensor,
            rank=rank,
            expected="contiguous",
            found=f"parameter {view.param!r} with strides {tuple(param.stride())}",
        )
    if view.offset < 0 or view.offset + view.numel > param.numel():
        raise OutOfBoundsError(
            "storage view runs past its parameter",
            tensor=tensor,
            rank=rank,
            expected=f"[{view.offset}, {view.offset + view.numel}) inside {param.numel()} elements",
            found=f"parameter {view.param!r} of shape {tuple(param.shape)}",
        )
    return param.view(-1)[view.offset : view.offset + view.numel].view(view.shape)


def piece_view(storage: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The elements of ``piece`` inside ``storage`` (a view), shaped like its box."""
    return torch.as_strided(storage, piece.box.extent, piece.strides, storage.storage_offset() + piece.offset)


def write_segment(
    storage: torch.Tensor, offset: int, strides: tuple[int, ...], extent: tuple[int, ...], data: torch.Tensor
) -> None:
    """Copy a received box into ``storage`` at ``(offset, strides)`` (a segment's target address)."""
    dst = torch.as_strided(storage, extent, strides, storage.storage_offset() + offset)
    dst.copy_(data.view(extent) if data.shape != torch.Size(extent) else data)


def write_pieces(storage: torch.Tensor, rank_storage: RankStorage, full: torch.Tensor) -> int:
    """Copy this rank's pieces of the whole logical tensor ``full`` into ``storage``; returns elements
    written. This is how a worker applies a checkpoint through its maps; a sync writes the same addresses
    segment by segment."""
    written = 0
    for piece in rank_storage.pieces:
        box = piece.box
        src = full[tuple(slice(o, o + e) for o, e in zip(box.origin, box.extent, strict=True))]
        piece_view(storage, piece).copy_(src)
        written += box.numel
    return written


def covered_ranges(views: Iterable[StorageView], param: str) -> list[tuple[int, int]]:
    """Sorted flat ranges of ``param`` that some storage view covers."""
    return sorted((v.offset, v.offset + v.numel) for v in views if v.param == param)


def uncovered_ranges(numel: int, covered: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The flat ranges of a parameter of ``numel`` elements that no storage covers (padding)."""
    out = []
    cursor = 0
    for start, stop in sorted(covered):
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, stop)
    if cursor < numel:
        out.append((cursor, numel))
    return out
