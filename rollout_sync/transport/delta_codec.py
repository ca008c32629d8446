"""Coding the changed elements of one message for a delta sync (pure torch: no process group).

A message's elements are compared as their bit patterns (an integer view of the wire dtype), so the test is
exact: ``-0.0`` differs from ``0.0``, and a NaN equals itself bit for bit. What changed is sent as

- **positions**: the gap before each changed element (elements skipped since the previous one), one byte
  each; a gap of 255 or more is the byte 255 followed, in a second stream, by the gap as an int32;
- **values**, for 2- and 4-byte dtypes: the difference between the new and the old bit pattern, one signed
  byte each; a difference outside ``[-127, 127]`` is the byte -128 followed, in a second stream, by the new
  bit pattern. For floating dtypes of one sign the bit patterns are ordered like the values, so the
  difference counts units in the last place: an optimizer step that moves a bf16 weight by a few ulps
  costs one byte. Other sizes send the new bit patterns as they are.

At 1% of the elements changed at random positions a changed bf16 element costs about 2.3 bytes (1 + 0.08·4
for its position, 1 for its value when it moved by at most 127 ulps), against 2 bytes per element, changed
or not, for the whole message.

Payload layout (little endian): four int64 ``[n, gap escapes, value escapes, itemsize]``, then the gap
bytes, the gap escapes (int32, at a multiple of 4), the value bytes (only where differences are coded), the
value escapes or raw values (bit patterns, at a multiple of 8). The receiver needs the old values at the
changed positions to decode differences: ``decode_positions`` first, then ``decode_values``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "HEAD_BYTES",
    "bits_dtype",
    "changed_positions",
    "decode_positions",
    "decode_values",
    "encode",
    "encoded_bytes",
    "max_encoded_bytes",
]

HEAD_BYTES = 32
_GAP_ESCAPE = 255
_VALUE_ESCAPE = -128
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(itemsize: int) -> torch.dtype:
    """The integer dtype whose view of an element is its bit pattern."""
    try:
        return _BITS[itemsize]
    except KeyError:
        raise ValueError(f"no integer view for elements of {itemsize} bytes") from None


def _diff_coded(itemsize: int) -> bool:
    return itemsize in (2, 4)


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class _Layout:
    n: int
    gap_escapes: int
    value_escapes: int
    itemsize: int

    @property
    def gaps(self) -> int:
        return HEAD_BYTES

    @property
    def gap_escape_at(self) -> int:
        return _up(self.gaps + self.n, 4)

    @property
    def values_at(self) -> int:
        return self.gap_escape_at + 4 * self.gap_escapes

    @property
    def raw_at(self) -> int:
        coded = self.n if _diff_coded(self.itemsize) else 0
        return _up(self.values_at + coded, 8)

    @property
    def raw_count(self) -> int:
        return self.value_escapes if _diff_coded(self.itemsize) else self.n

    @property
    def nbytes(self) -> int:
        return self.raw_at + self.raw_count * self.itemsize


SAMPLE_EVERY = 16
"""``changed_positions`` first compares every 16th word: a message far past the limit is sent whole without
a full comparison (its count of changed elements is then estimated from that sample, of at least 1,024
words)."""


def changed_positions(new: torch.Tensor, old: torch.Tensor, limit: int) -> tuple[int, torch.Tensor | None]:
    """How many bit patterns of ``new`` and ``old`` (1-D, the same integer dtype) differ, and their sorted
    positions (int64); or, when more than ``limit`` differ (the caller sends the whole message then), their
    count and None. The count is exact, except for a message whose sample (every ``SAMPLE_EVERY``-th word)
    already shows more than twice the limit: then it is the sample's count scaled up.

    Compared 8 bytes at a time (the elements of a word at once), then element by element within the words
    that differ. On CPU through NumPy: its comparison and ``flatnonzero`` take 6.3 ms for a 16 MiB message
    here, torch's 12 ms; with 1% of the elements changed the whole search takes about 15-20 ms."""
    itemsize = new.element_size()
    lanes = 8 // itemsize
    head = new.numel() // lanes * lanes
    aligned = all(t.storage_offset() * itemsize % 8 == 0 for t in (new, old))
    if lanes == 1 or head == 0 or not aligned or new.device.type != "cpu":
        differs = new != old
        count = int(torch.count_nonzero(differs))
        return (count, None) if count > limit else (count, differs.nonzero().squeeze(1))
    words_new, words_old = new[:head].numpy().view(np.int64), old[:head].numpy().view(np.int64)
    tail = np.flatnonzero(new[head:].numpy() != old[head:].numpy()) + head
    bits = 8 * itemsize
    if words_new.size >= 1024 * SAMPLE_EVERY:  # every SAMPLE_EVERY-th word first
        sampled = _lanes(words_new[::SAMPLE_EVERY] ^ words_old[::SAMPLE_EVERY], lanes, bits)
        estimate = int(np.count_nonzero(sampled)) * SAMPLE_EVERY
        if estimate > 2 * limit:
            return estimate + int(tail.size), None
    at = np.flatnonzero(words_new != words_old)  # 6.3 ms for 16 MiB here; XOR then flatnonzero 14 ms
    lane_differs = _lanes(np.take(words_new, at) ^ np.take(words_old, at), lanes, bits)
    if at.size + tail.size > limit:  # at least that many elements differ
        return int(np.count_nonzero(lane_differs)) + int(tail.size), None
    row, lane = np.nonzero(lane_differs)
    positions = np.concatenate([np.take(at, row) * lanes + lane, tail])
    count = positions.size
    return (count, None) if count > limit else (count, torch.from_numpy(positions))


def _lanes(xor: np.ndarray, lanes: int, bits: int) -> np.ndarray:
    """For XORs of words: whether each of its ``lanes`` elements of ``bits`` bits differs (little endian:
    element ``k`` of a word is its bits ``[bits·k, bits·(k+1))``)."""
    mask = (1 << bits) - 1
    return np.stack([(xor >> (bits * k)) & mask != 0 for k in range(lanes)], axis=1)


def max_encoded_bytes(n: int, itemsize: int) -> int:
    """An upper bound of the payload for ``n`` changed elements of ``itemsize`` bytes."""
    return HEAD_BYTES + 16 + n * (1 + 4 + 1 + itemsize)


def _wrap(d: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``d`` (int64) reduced to the signed range of ``itemsize`` (at most 4) bytes, two's complement."""
    half = 1 << (8 * itemsize - 1)
    return ((d + half) & (2 * half - 1)) - half


def encode(
    new: torch.Tensor,
    old: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    values: torch.Tensor | None = None,
) -> int:
    """Write the changes at ``positions`` (from ``changed_positions``) of ``new`` against ``old`` (bit
    patterns) into ``out`` (uint8, at least ``max_encoded_bytes`` long; it may be ``new``'s own memory);
    returns the payload's bytes. ``values``: ``new`` at ``positions``, if the caller has them."""
    itemsize = new.element_size()
    n = positions.numel()
    gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
    gap_escaped = gaps >= _GAP_ESCAPE
    gap_escapes = gaps[gap_escaped].to(torch.int32)
    if values is None:
        values = new.index_select(0, positions)
    if _diff_coded(itemsize):
        d = _wrap(values.to(torch.int64) - old.index_select(0, positions).to(torch.int64), itemsize)
        escaped = (d < -127) | (d > 127)
        small = torch.where(escaped, _VALUE_ESCAPE, d).to(torch.int8)
        raw = values[escaped]
    else:
        small = None
        raw = values
    layout = _Layout(n, gap_escapes.numel(), raw.numel() if small is not None else 0, itemsize)
    if out.numel() < layout.nbytes:
        raise ValueError(f"a delta payload of {layout.nbytes} bytes does not fit in {out.numel()}")
    out[:HEAD_BYTES].view(torch.int64).copy_(
        torch.tensor([n, layout.gap_escapes, layout.value_escapes, itemsize], dtype=torch.int64)
    )
    out[layout.gaps : layout.gaps + n].copy_(gaps.clamp(max=_GAP_ESCAPE).to(torch.uint8))
    at = layout.gap_escape_at
    out[at : at + 4 * layout.gap_escapes].view(torch.int32).copy_(gap_escapes)
    if small is not None:
        out[layout.values_at : layout.values_at + n].view(torch.int8).copy_(small)
    at = layout.raw_at
    out[at : at + raw.numel() * itemsize].view(raw.dtype).copy_(raw)
    return layout.nbytes


def encoded_bytes(payload: torch.Tensor) -> int:
    """The size of the payload that starts ``payload`` (its head says)."""
    return _read_layout(payload).nbytes


def _read_layout(payload: torch.Tensor) -> _Layout:
    n, gap_escapes, value_escapes, itemsize = (int(v) for v in payload[:HEAD_BYTES].view(torch.int64))
    bits_dtype(itemsize)
    return _Layout(n, gap_escapes, value_escapes, itemsize)


def decode_positions(payload: torch.Tensor) -> torch.Tensor:
    """The changed positions (int64, sorted) a payload carries."""
    layout = _read_layout(payload)
    gaps = payload[layout.gaps : layout.gaps + layout.n].to(torch.int64)
    escaped = gaps == _GAP_ESCAPE
    at = layout.gap_escape_at
    escapes = payload[at : at + 4 * layout.gap_escapes].view(torch.int32).to(torch.int64)
    if int(torch.count_nonzero(escaped)) != escapes.numel() or bool((escapes < _GAP_ESCAPE).any()):
        raise ValueError("a delta payload's gap escapes do not match its gaps")
    gaps[escaped] = escapes
    return torch.cumsum(gaps + 1, 0) - 1


def decode_values(payload: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The new bit patterns at the payload's positions, given the ``old`` ones there (same integer dtype)."""
    layout = _read_layout(payload)
    itemsize = layout.itemsize
    bits = bits_dtype(itemsize)
    at = layout.raw_at
    raw = payload[at : at + layout.raw_count * itemsize].view(bits)
    if not _diff_coded(itemsize):
        return raw.clone()
    small = payload[layout.values_at : layout.values_at + layout.n].view(torch.int8).to(torch.int64)
    escaped = small == _VALUE_ESCAPE
    if int(torch.count_nonzero(escaped)) != raw.numel():
        raise ValueError("a delta payload's value escapes do not match its values")
    new = _wrap(old.to(torch.int64) + small, itemsize)
    new[escaped] = raw.to(torch.int64)
    return new.to(bits)
