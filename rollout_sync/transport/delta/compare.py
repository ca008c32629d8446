"""Finding the changed elements of a message on CPU, for a delta sync (``delta``): NumPy, no process group.

A message is compared as **runs**: pairs of same-shaped arrays of bit patterns (the new elements, wherever
they are: a source storage or the packed message; the old ones in the sender's shadow), 1-D or 2-D with a
contiguous last axis, each at an element offset of the message. Elements are compared 8 bytes at a time
(the elements of a word at once, where both sides share their alignment), then lane by lane within the words
that differ: the differing words' XOR, viewed as the element dtype, has its nonzero entries exactly at the
changed elements. A run's unaligned head and tail (and a run whose sides are not aligned alike) are compared
element by element.

Runs are compared in chunks of ``CHUNK_WORDS`` words (the comparison's mask stays in cache); past ``limit``
changed elements the search stops (the message is then sent whole) and reports the count of the part it
compared, scaled to the whole.

What it finds lands in ``Scratch``: buffers kept by the caller across messages and syncs (grown to the
largest need so far, never shrunk), so a sync allocates (and page-faults) nothing per message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CHUNK_WORDS", "Changes", "Run", "Scratch", "find_changes", "np_bits"]

CHUNK_WORDS = 1 << 17
"""Words compared at once (1 MiB of each side): the mask (128 KiB) and what it finds stay in cache."""

_NP_BITS: dict[int, type[np.integer]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def np_bits(itemsize: int) -> np.dtype:
    """The NumPy integer dtype whose view of an element is its bit pattern."""
    try:
        return np.dtype(_NP_BITS[itemsize])
    except KeyError:
        raise ValueError(f"no integer view for elements of {itemsize} bytes") from None


class Scratch:
    """Grow-only buffers, one per key, reused across messages and syncs. They hold what one message's
    changes need: on a sender ``16 + 3·itemsize`` bytes per changed element (positions, gaps, new and old
    bit patterns, differences), on a receiver 8 (positions, then offsets) plus ``delta.landing.APPLY_CHUNK``
    elements; and a comparison mask of ``CHUNK_WORDS`` bytes. With at most ``1/MAX_CHANGED_SHARE`` of a
    message coded, that is at most about 0.35 bytes per byte of the largest bf16 message."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def get(self, key: str, n: int, dtype: np.dtype | type[np.generic]) -> np.ndarray:
        """``n`` elements of ``dtype`` (uninitialized), in the buffer named ``key``."""
        dtype = np.dtype(dtype)
        need = n * dtype.itemsize
        buffer = self._buffers.get(key)
        if buffer is None or buffer.nbytes < need:
            self._buffers.pop(key, None)  # release before allocating the larger one
            buffer = self._buffers[key] = np.empty(max(need + need // 4, 4096), dtype=np.uint8)
        return buffer[:need].view(dtype)


@dataclass(frozen=True, slots=True)
class Run:
    """New and old bit patterns of the same shape (1-D, or 2-D with a contiguous last axis), the first of
    them element ``at`` of the message; a 2-D run's elements follow each other row by row in the message."""

    new: np.ndarray
    old: np.ndarray
    at: int


@dataclass(frozen=True, slots=True)
class Changes:
    """The changed elements of a message: sorted positions (int64) and the new and old bit patterns there
    (views of the scratch: valid until its next use)."""

    positions: np.ndarray
    new: np.ndarray
    old: np.ndarray

    @property
    def count(self) -> int:
        return int(self.positions.size)


@dataclass(frozen=True, slots=True)
class _Piece:
    """Words to compare: 1-D or 2-D (rows of ``words`` each), ``lanes`` elements per word, the first word's
    first element at element ``at`` of the message."""

    new: np.ndarray
    old: np.ndarray
    lanes: int
    at: int


def _pieces(run: Run, itemsize: int) -> Iterator[_Piece]:
    new, old = run.new, run.old
    if new.shape != old.shape or new.ndim not in (1, 2) or new.dtype != old.dtype:
        raise ValueError(f"a run pairs {new.shape} {new.dtype} with {old.shape} {old.dtype}")
    if new.ndim == 2 and new.shape[0] == 1:
        new, old = new[0], old[0]
    lanes = 8 // itemsize
    a, b = new.ctypes.data, old.ctypes.data
    if lanes == 1 or (a - b) % 8:
        yield _Piece(new, old, 1, run.at)
        return
    if new.ndim == 2:
        cols = new.shape[1]
        if cols % lanes == 0 and a % 8 == 0 and new.strides[0] % 8 == 0 and old.strides[0] % 8 == 0:
            yield _Piece(new.view(np.int64), old.view(np.int64), lanes, run.at)
        else:
            yield _Piece(new, old, 1, run.at)
        return
    n = new.size
    head = min(n, (-a % 8) // itemsize)
    body = (n - head) // lanes * lanes
    if head:
        yield _Piece(new[:head], old[:head], 1, run.at)
    if body:
        end = head + body
        yield _Piece(new[head:end].view(np.int64), old[head:end].view(np.int64), lanes, run.at + head)
    if head + body < n:
        yield _Piece(new[head + body :], old[head + body :], 1, run.at + head + body)


def find_changes(
    runs: Sequence[Run], itemsize: int, limit: int, scratch: Scratch, update: bool = False
) -> tuple[int, Changes | None]:
    """How many elements of the runs differ, and where (``Changes``); or, past ``limit`` changed elements,
    the count (exact for what was compared when the search stopped, scaled up to every element of the
    runs) and None. ``update``: copy each differing word of ``new`` into ``old`` as it is found (while it
    is in cache; past the limit, only part of them)."""
    bits = np_bits(itemsize)
    total = sum(r.new.size for r in runs)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    count = compared = 0
    for run in runs:
        for piece in _pieces(run, itemsize):
            for positions, new, old, elements in _chunks(piece, bits, scratch, update):
                compared += elements
                if positions.size == 0:
                    continue
                count += positions.size
                if count > limit:
                    return round(count * total / compared), None
                found.append((positions, new, old))
    positions = scratch.get("positions", count, np.int64)
    new = scratch.get("new", count, bits)
    old = scratch.get("old", count, bits)
    if found:
        np.concatenate([f[0] for f in found], out=positions)
        np.concatenate([f[1] for f in found], out=new)
        np.concatenate([f[2] for f in found], out=old)
    return count, Changes(positions, new, old)


def _chunks(
    piece: _Piece, bits: np.dtype, scratch: Scratch, update: bool
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """Per chunk of a piece: the changed positions, new and old bit patterns, and the elements compared."""
    new, old, lanes = piece.new, piece.old, piece.lanes
    rows, words = (1, new.shape[0]) if new.ndim == 1 else new.shape
    if rows * words == 0:
        return
    if new.ndim == 2:  # whole rows at a time
        span, step, per = rows, max(1, CHUNK_WORDS // words), words
    else:
        span, step, per = words, CHUNK_WORDS, 1
    mask_all = scratch.get("mask", min(step, span) * per, np.bool_)
    shift = lanes.bit_length() - 1
    for start in range(0, span, step):
        a, b = new[start : start + step], old[start : start + step]
        mask = mask_all[: a.size].reshape(a.shape)
        np.not_equal(a, b, out=mask)
        at = np.flatnonzero(mask)
        elements = a.size * lanes
        first = start * per  # the chunk's first word in the piece
        if at.size == 0:
            yield at, at, at, elements
            continue
        if new.ndim == 2:
            row, col = np.divmod(at, words)
            new_words, old_words = a[row, col], b[row, col]
            if update:
                b[row, col] = new_words
        else:
            new_words, old_words = np.take(a, at), np.take(b, at)
            if update:
                np.put(b, at, new_words)
        if lanes == 1:
            yield at + (first + piece.at), new_words, old_words, elements
            continue
        new_lanes, old_lanes = new_words.view(bits), old_words.view(bits)
        lane = np.flatnonzero(np.not_equal(new_lanes, old_lanes))
        positions = np.take(at, lane >> shift)
        positions += first
        positions <<= shift
        positions += lane & (lanes - 1)
        positions += piece.at
        yield positions, np.take(new_lanes, lane), np.take(old_lanes, lane), elements
