"""Where a coded message's changes land on the receiver of a delta sync (``delta``): ``Landing`` holds a
message's copies as tables (one row per copy) and finds, for sorted element positions of the message, the
target storage and element offset of each; ``apply_changes`` reads the old values there, decodes the new ones
(``delta.change_codec``) and writes them.

On CPU (NumPy, into the caller's ``Scratch``) a message whose copies are all 1-D (every vLLM shard a
ZeRO-3 partition lands in) finds its offsets with one binary search per copy (where the copy's first element
falls among the positions) and one affine map per element; other copies unravel per element, through
``Landing.locate``. Elsewhere (a device) it runs in torch, per element: a binary search among the copies and
an unravel per axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.program import PartProgram
from ..core.target_streams import Targets
from .change_codec import (
    apply_values,
    bits_dtype,
    coded_values,
    decode_positions,
    decode_positions_into,
    decode_values,
)
from .compare import Scratch

__all__ = ["APPLY_CHUNK", "Landing", "apply_changes"]

APPLY_CHUNK = 8192
"""Changes read, decoded and written back at once on CPU: at 1% changed their cache lines (512 KiB) stay
in cache between the read and the write."""


@dataclass(frozen=True)
class Landing:
    """Where each element of one message lands in this rank's target storages: one row per copy (first
    element in the message, extent and strides padded on the left to the same number of axes, storage
    offset, index of its target name); ``groups``: the runs of consecutive rows of one target name
    ``(name index, first row, end row)``; ``flat``: every copy is 1-D, its element ``i`` at storage offset
    ``base + i·stride`` for the message's element ``i`` (``bases``, ``row_strides``)."""

    itemsize: int
    wire: torch.dtype
    names: tuple[str, ...]
    starts: torch.Tensor
    extents: torch.Tensor
    strides: torch.Tensor
    offsets: torch.Tensor
    name_index: torch.Tensor
    groups: tuple[tuple[int, int, int], ...]
    flat: bool
    bases: np.ndarray
    row_strides: np.ndarray

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

        groups: list[tuple[int, int, int]] = []
        for i, r in enumerate(rows):
            if groups and groups[-1][0] == r[4]:
                groups[-1] = (r[4], groups[-1][1], i + 1)
            else:
                groups.append((r[4], i, i + 1))
        flat = all(all(e == 1 for e in r[1][:-1]) for r in rows)
        row_strides = np.array([r[2][-1] for r in rows], dtype=np.int64)
        return cls(
            itemsize=itemsize,
            wire=parts[0].wire,
            names=tuple(names),
            starts=torch.tensor([r[0] for r in rows], dtype=torch.int64),
            extents=torch.tensor([pad(r[1], 1) for r in rows], dtype=torch.int64),
            strides=torch.tensor([pad(r[2], 0) for r in rows], dtype=torch.int64),
            offsets=torch.tensor([r[3] for r in rows], dtype=torch.int64),
            name_index=torch.tensor([r[4] for r in rows], dtype=torch.int64),
            groups=tuple(groups),
            flat=flat,
            bases=np.array([r[3] for r in rows], dtype=np.int64) - row_strides * [r[0] for r in rows],
            row_strides=row_strides,
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

    def row_bounds(self, positions: np.ndarray) -> np.ndarray:
        """For sorted positions: where each row's positions begin among them, and their end (rows + 1)."""
        bounds = np.empty(len(self.bases) + 1, dtype=np.int64)
        bounds[:-1] = np.searchsorted(positions, self.starts.numpy())
        bounds[-1] = positions.size
        return bounds

    def offsets_into(self, positions: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Turn sorted positions (``row_bounds`` of them) into their storage offsets, in place."""
        counts = np.diff(bounds)
        if not self.flat:
            _, offsets = self.locate(torch.from_numpy(positions))
            positions[:] = offsets.numpy()
            return positions
        if bool((self.row_strides != 1).any()):
            positions *= np.repeat(self.row_strides, counts)
        positions += np.repeat(self.bases, counts)
        return positions


def _flat(storage: torch.Tensor) -> torch.Tensor:
    """Every element of ``storage``'s memory from its own offset on, as one flat tensor."""
    span = storage.untyped_storage().nbytes() // storage.element_size() - storage.storage_offset()
    return torch.as_strided(storage, (span,), (1,), storage.storage_offset())


def apply_changes(
    payload: torch.Tensor,
    landing: Landing,
    targets: Targets,
    elements: int,
    scratch: Scratch | None = None,
    touched: set[str] | None = None,
) -> int:
    """Write a coded message's changes into the targets (the message has ``elements`` elements); returns how
    many elements changed, and adds to ``touched`` the targets at least one of them landed in. On CPU with
    a ``scratch`` through NumPy, else torch."""
    if touched is None:
        touched = set()
    if payload.device.type != "cpu" or scratch is None:
        return _apply_torch(payload, landing, targets, elements, touched)
    data = payload.numpy()
    positions = decode_positions_into(data, scratch)
    n = positions.size
    if n and not 0 <= int(positions[-1]) < elements:
        raise ValueError(f"a delta payload names element {int(positions[-1])} of a message of {elements}")
    small, raw, escaped = coded_values(data)
    bounds = landing.row_bounds(positions)
    offsets = landing.offsets_into(positions, bounds)
    bits = bits_dtype(landing.itemsize)
    for name, first, end in landing.groups:
        a, b = int(bounds[first]), int(bounds[end])
        if a == b:
            continue
        touched.add(landing.names[name])
        flat = _flat(targets.get(landing.names[name]))
        if flat.device.type != "cpu" or flat.dtype != landing.wire:  # cast, or move, per target
            index = torch.from_numpy(offsets[a:b]).to(flat.device)
            old = flat.index_select(0, index).to(landing.wire).view(bits).cpu().numpy()
            new = torch.from_numpy(apply_values(old, a, small, raw, escaped))
            flat.index_copy_(0, index, new.view(landing.wire).to(device=flat.device, dtype=flat.dtype))
            continue
        store = flat.view(bits).numpy()
        chunk = scratch.get("old", min(b - a, APPLY_CHUNK), store.dtype)
        for c in range(a, b, APPLY_CHUNK):  # read, decode and write back while the lines are in cache
            at = offsets[c : min(b, c + APPLY_CHUNK)]
            old = chunk[: at.size]
            if small is not None:
                np.take(store, at, out=old, mode="clip")  # offsets of elements < elements: in range
            store[at] = apply_values(old, c, small, raw, escaped)
    return n


def _apply_torch(
    payload: torch.Tensor, landing: Landing, targets: Targets, elements: int, touched: set[str]
) -> int:
    positions = decode_positions(payload).cpu()  # the landing's tables live on CPU
    if positions.numel() and not 0 <= int(positions[-1]) < elements:
        raise ValueError(f"a delta payload names element {int(positions[-1])} of a message of {elements}")
    name_index, offsets = landing.locate(positions)
    names, counts = torch.unique_consecutive(name_index, return_counts=True)
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    touched.update(landing.names[int(i)] for i in names)
    flats = [_flat(targets.get(landing.names[int(i)])) for i in names]
    indices = [offsets[a:b].to(flat.device) for flat, a, b in zip(flats, bounds, bounds[1:], strict=False)]
    old = torch.empty(positions.numel(), dtype=landing.wire, device=payload.device)
    for flat, index, a, b in zip(flats, indices, bounds, bounds[1:], strict=False):
        old[a:b] = flat.index_select(0, index)  # index_select, index_copy_: 4-5x faster than [] here
    new = decode_values(payload, old.view(bits_dtype(landing.itemsize))).view(landing.wire)
    for flat, index, a, b in zip(flats, indices, bounds, bounds[1:], strict=False):
        flat.index_copy_(0, index, new[a:b].to(device=flat.device, dtype=flat.dtype))
    return positions.numel()
