"""Where a coded message's changes land on the receiver of a delta sync (``delta``): ``Landing`` holds a
message's copies as tables (one row per copy) and finds, for sorted element positions of the message, the
target storage and element offset of each (a binary search and an unravel per element); ``apply_changes``
reads the old values there, decodes the new ones (``delta_codec``) and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .delta_codec import bits_dtype, decode_positions, decode_values
from .program import PartProgram
from .targets import Targets

__all__ = ["Landing", "apply_changes"]


@dataclass(frozen=True)
class Landing:
    """Where each element of one message lands in this rank's target storages: one row per copy (first
    element in the message, extent and strides padded on the left to the same number of axes, storage
    offset, index of its target name)."""

    itemsize: int
    wire: torch.dtype
    names: tuple[str, ...]
    starts: torch.Tensor
    extents: torch.Tensor
    strides: torch.Tensor
    offsets: torch.Tensor
    name_index: torch.Tensor

    @classmethod
    def of(cls, parts: tuple[PartProgram, ...], itemsize: int) -> Landing:
        names: list[str] = []
        rows = []
        for p in parts:
            if p.name not in names:
                names.append(p.name)
            base = p.byte_offset // itemsize
            for c in p.copies:
                rows.append((base + c.buffer_offset, c.extent, c.strides, c.offset, names.index(p.name)))
        ndim = max(len(r[1]) for r in rows)

        def pad(values: tuple[int, ...], fill: int) -> list[int]:
            return [fill] * (ndim - len(values)) + list(values)

        return cls(
            itemsize=itemsize,
            wire=parts[0].wire,
            names=tuple(names),
            starts=torch.tensor([r[0] for r in rows], dtype=torch.int64),
            extents=torch.tensor([pad(r[1], 1) for r in rows], dtype=torch.int64),
            strides=torch.tensor([pad(r[2], 0) for r in rows], dtype=torch.int64),
            offsets=torch.tensor([r[3] for r in rows], dtype=torch.int64),
            name_index=torch.tensor([r[4] for r in rows], dtype=torch.int64),
        )

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For sorted element positions of the message: the index of each one's target name, and its
        element offset in that target's storage (relative to the storage's own offset)."""
        row = torch.searchsorted(self.starts, positions, right=True) - 1
        local = positions - self.starts.index_select(0, row)
        offset = self.offsets.index_select(0, row)
        axes = self.extents.shape[1]
        for axis in reversed(range(1, axes)):
            extent = self.extents[:, axis].index_select(0, row)
            offset = offset + (local % extent) * self.strides[:, axis].index_select(0, row)
            local = local // extent
        offset = offset + local * self.strides[:, 0].index_select(0, row)  # within the first axis' extent
        return self.name_index.index_select(0, row), offset


def _flat(storage: torch.Tensor) -> torch.Tensor:
    """Every element of ``storage``'s memory from its own offset on, as one flat tensor."""
    span = storage.untyped_storage().nbytes() // storage.element_size() - storage.storage_offset()
    return torch.as_strided(storage, (span,), (1,), storage.storage_offset())


def apply_changes(payload: torch.Tensor, landing: Landing, targets: Targets, elements: int) -> int:
    """Write a coded message's changes into the targets (the message has ``elements`` elements); returns how
    many elements changed."""
    positions = decode_positions(payload)
    if positions.numel() and not 0 <= int(positions[-1]) < elements:
        raise ValueError(f"a delta payload names element {int(positions[-1])} of a message of {elements}")
    name_index, offsets = landing.locate(positions)
    names, counts = torch.unique_consecutive(name_index, return_counts=True)
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    flats = [_flat(targets.get(landing.names[int(i)])) for i in names]
    old = torch.empty(positions.numel(), dtype=landing.wire)
    for flat, a, b in zip(flats, bounds, bounds[1:], strict=False):
        old[a:b] = flat.index_select(0, offsets[a:b])  # index_select, index_copy_: 4-5x faster than [] here
    new = decode_values(payload, old.view(bits_dtype(landing.itemsize))).view(landing.wire)
    for flat, a, b in zip(flats, bounds, bounds[1:], strict=False):
        flat.index_copy_(0, offsets[a:b], new[a:b].to(flat.dtype))
    return positions.numel()
