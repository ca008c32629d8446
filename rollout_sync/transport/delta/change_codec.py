"""Coding the changed elements of one message for a delta sync (no process group).

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

Two implementations write the same bytes: on CPU NumPy in the element's own integer dtype (its wrapping
arithmetic is the difference modulo ``2**bits``), into the caller's ``Scratch`` (``encode_changes``,
``decode_positions_into``, ``coded_values`` / ``apply_values``): about 5 ns per changed element to code, 4 to
decode the positions here; on a device torch, in int64 (``encode``, ``decode_positions``, ``decode_values``
pick by device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .compare import Changes, Run, Scratch, find_changes, np_bits

__all__ = [
    "HEAD_BYTES",
    "apply_values",
    "bits_dtype",
    "changed_positions",
    "coded_values",
    "decode_positions",
    "decode_positions_into",
    "decode_values",
    "decode_values_into",
    "encode",
    "encode_changes",
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


def changed_positions(new: torch.Tensor, old: torch.Tensor, limit: int) -> tuple[int, torch.Tensor | None]:
    """How many bit patterns of ``new`` and ``old`` (1-D, the same integer dtype) differ, and their sorted
    positions (int64); or, when more than ``limit`` differ (the caller sends the whole message then), their
    count (on CPU: exact for the part compared when the search stopped, scaled up) and None. On CPU through
    ``delta.compare``, word by word."""
    if new.device.type != "cpu" or old.device.type != "cpu":
        differs = new != old
        count = int(torch.count_nonzero(differs))
        return (count, None) if count > limit else (count, differs.nonzero().squeeze(1))
    run = Run(new.numpy(), old.numpy(), 0)
    count, changes = find_changes([run], new.element_size(), limit, Scratch())
    return count, None if changes is None else torch.from_numpy(changes.positions)


def max_encoded_bytes(n: int, itemsize: int) -> int:
    """An upper bound of the payload for ``n`` changed elements of ``itemsize`` bytes."""
    return HEAD_BYTES + 16 + n * (1 + 4 + 1 + itemsize)


def encoded_bytes(payload: torch.Tensor) -> int:
    """The size of the payload that starts ``payload`` (its head says)."""
    return _read_layout(payload[:HEAD_BYTES].cpu().numpy(), whole=False).nbytes


def _read_layout(payload: np.ndarray, whole: bool = True) -> _Layout:
    """The layout a payload's head gives (``whole``: checked against the payload's size)."""
    if payload.size < HEAD_BYTES:
        raise ValueError(f"a delta payload of {payload.size} bytes has no head")
    n, gap_escapes, value_escapes, itemsize = (int(v) for v in payload[:HEAD_BYTES].view(np.int64))
    bits_dtype(itemsize)
    if n < 0 or not 0 <= gap_escapes <= n or not 0 <= value_escapes <= n:
        raise ValueError(f"a delta payload's head ({n}, {gap_escapes}, {value_escapes}) does not add up")
    layout = _Layout(n, gap_escapes, value_escapes, itemsize)
    if whole and layout.nbytes > payload.size:
        raise ValueError(f"a delta payload of {payload.size} bytes is shorter than its head says")
    return layout


# -- on CPU: NumPy, into the caller's scratch -----------------------------------------------------------------


def encode_changes(changes: Changes, itemsize: int, out: np.ndarray, scratch: Scratch) -> int:
    """Write ``changes`` (from ``delta.compare.find_changes``; their scratch buffers are read, not reused)
    into ``out`` (uint8, at least ``max_encoded_bytes`` long); returns the payload's bytes."""
    positions, new, old = changes.positions, changes.new, changes.old
    n = positions.size
    gaps = scratch.get("gaps", n, np.int64)
    if n:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    gap_escaped = np.flatnonzero(gaps >= _GAP_ESCAPE)
    if _diff_coded(itemsize):
        d = scratch.get("diff", n, new.dtype)
        np.subtract(new, old, out=d)  # wraps: the difference modulo 2**bits, as _wrap
        shifted = d.view(np.dtype(f"u{itemsize}"))
        shifted += 127  # 0..254 where the difference is in [-127, 127]
        value_escaped = shifted > 254
        raw = new[value_escaped]
    else:
        raw = new
    layout = _Layout(n, gap_escaped.size, raw.size if _diff_coded(itemsize) else 0, itemsize)
    if out.size < layout.nbytes:
        raise ValueError(f"a delta payload of {layout.nbytes} bytes does not fit in {out.size}")
    out[:HEAD_BYTES].view(np.int64)[:] = (n, layout.gap_escapes, layout.value_escapes, itemsize)
    np.minimum(gaps, _GAP_ESCAPE, out=out[layout.gaps : layout.gaps + n], casting="unsafe")
    at = layout.gap_escape_at
    out[at : at + 4 * layout.gap_escapes].view(np.int32)[:] = np.take(gaps, gap_escaped)
    if _diff_coded(itemsize):
        small = out[layout.values_at : layout.values_at + n]
        np.subtract(shifted, 127, out=small, casting="unsafe")  # the low byte of the difference
        small.view(np.int8)[value_escaped] = _VALUE_ESCAPE
    at = layout.raw_at
    out[at : at + raw.size * itemsize].view(raw.dtype)[:] = raw
    return layout.nbytes


def decode_positions_into(payload: np.ndarray, scratch: Scratch) -> np.ndarray:
    """The changed positions (int64, sorted) a payload (uint8) carries, in ``scratch``."""
    layout = _read_layout(payload)
    gaps = payload[layout.gaps : layout.gaps + layout.n]
    positions = scratch.get("positions", layout.n, np.int64)
    escaped = np.flatnonzero(gaps == _GAP_ESCAPE)
    at = layout.gap_escape_at
    escapes = payload[at : at + 4 * layout.gap_escapes].view(np.int32)
    if escaped.size != escapes.size or bool((escapes < _GAP_ESCAPE).any()):
        raise ValueError("a delta payload's gap escapes do not match its gaps")
    np.add(gaps, 1, out=positions, dtype=np.int64)
    positions[escaped] = escapes.astype(np.int64) + 1
    np.cumsum(positions, out=positions)
    positions -= 1
    return positions


def coded_values(payload: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """A payload's values as it codes them: the signed byte differences (None for element sizes whose new
    bit patterns travel as they are), the raw bit patterns, and which changes (sorted indices) take a raw
    one instead of a difference (those whose difference is the escape byte; empty without differences)."""
    layout = _read_layout(payload)
    itemsize = layout.itemsize
    at = layout.raw_at
    raw = payload[at : at + layout.raw_count * itemsize].view(np_bits(itemsize))
    if not _diff_coded(itemsize):
        return None, raw, np.empty(0, dtype=np.int64)
    small = payload[layout.values_at : layout.values_at + layout.n].view(np.int8)
    escaped = np.flatnonzero(small == _VALUE_ESCAPE)
    if escaped.size != raw.size:
        raise ValueError("a delta payload's value escapes do not match its values")
    return small, raw, escaped


def apply_values(
    old: np.ndarray, first: int, small: np.ndarray | None, raw: np.ndarray, escaped: np.ndarray
) -> np.ndarray:
    """Turn ``old`` (the old bit patterns of changes ``first`` on, ``coded_values`` of their payload) into
    the new ones, in place."""
    end = first + old.size
    if small is None:
        old[:] = raw[first:end]
        return old
    np.add(old, small[first:end], out=old)  # wraps, as _wrap
    lo, hi = np.searchsorted(escaped, (first, end))
    if hi > lo:
        old[escaped[lo:hi] - first] = raw[lo:hi]
    return old


def decode_values_into(payload: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Turn ``old`` (the old bit patterns at the payload's positions) into the new ones, in place."""
    small, raw, escaped = coded_values(payload)
    if old.size != (raw.size if small is None else small.size) or old.dtype != raw.dtype:
        raise ValueError(f"{old.size} old values of {old.dtype} for a payload of {raw.dtype} changes")
    return apply_values(old, 0, small, raw, escaped)


# -- tensors: NumPy on CPU, torch elsewhere -------------------------------------------------------------------


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
    if values is None:
        values = new.index_select(0, positions)
    if all(t.device.type == "cpu" for t in (old, positions, out, values)):
        p = positions.numpy()
        changes = Changes(p, values.numpy(), np.take(old.numpy(), p))
        return encode_changes(changes, new.element_size(), out.numpy(), Scratch())
    return _encode_torch(new.element_size(), old, positions, out, values)


def decode_positions(payload: torch.Tensor) -> torch.Tensor:
    """The changed positions (int64, sorted) a payload carries."""
    if payload.device.type == "cpu":
        return torch.from_numpy(decode_positions_into(payload.numpy(), Scratch()))
    return _decode_positions_torch(payload)


def decode_values(payload: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The new bit patterns at the payload's positions, given the ``old`` ones there (same integer dtype)."""
    if payload.device.type == "cpu" and old.device.type == "cpu":
        return torch.from_numpy(decode_values_into(payload.numpy(), old.numpy().copy()))
    return _decode_values_torch(payload, old)


def _wrap(d: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``d`` (int64) reduced to the signed range of ``itemsize`` (at most 4) bytes, two's complement."""
    half = 1 << (8 * itemsize - 1)
    return ((d + half) & (2 * half - 1)) - half


def _encode_torch(
    itemsize: int, old: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, values: torch.Tensor
) -> int:
    n = positions.numel()
    gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
    gap_escapes = gaps[gaps >= _GAP_ESCAPE].to(torch.int32)
    if _diff_coded(itemsize):
        d = _wrap(values.to(torch.int64) - old.index_select(0, positions).to(torch.int64), itemsize)
        escaped = (d < -127) | (d > 127)
        small: torch.Tensor | None = torch.where(escaped, _VALUE_ESCAPE, d).to(torch.int8)
        raw = values[escaped]
    else:
        small, raw = None, values
    layout = _Layout(n, gap_escapes.numel(), raw.numel() if small is not None else 0, itemsize)
    if out.numel() < layout.nbytes:
        raise ValueError(f"a delta payload of {layout.nbytes} bytes does not fit in {out.numel()}")
    head = torch.tensor([n, layout.gap_escapes, layout.value_escapes, itemsize], dtype=torch.int64)
    out[:HEAD_BYTES].view(torch.int64).copy_(head)
    out[layout.gaps : layout.gaps + n].copy_(gaps.clamp(max=_GAP_ESCAPE).to(torch.uint8))
    at = layout.gap_escape_at
    out[at : at + 4 * layout.gap_escapes].view(torch.int32).copy_(gap_escapes)
    if small is not None:
        out[layout.values_at : layout.values_at + n].view(torch.int8).copy_(small)
    at = layout.raw_at
    out[at : at + raw.numel() * itemsize].view(raw.dtype).copy_(raw)
    return layout.nbytes


def _torch_layout(payload: torch.Tensor) -> _Layout:
    layout = _read_layout(payload[:HEAD_BYTES].cpu().numpy(), whole=False)
    if layout.nbytes > payload.numel():
        raise ValueError(f"a delta payload of {payload.numel()} bytes is shorter than its head says")
    return layout


def _decode_positions_torch(payload: torch.Tensor) -> torch.Tensor:
    layout = _torch_layout(payload)
    gaps = payload[layout.gaps : layout.gaps + layout.n].to(torch.int64)
    escaped = gaps == _GAP_ESCAPE
    at = layout.gap_escape_at
    escapes = payload[at : at + 4 * layout.gap_escapes].view(torch.int32).to(torch.int64)
    if int(torch.count_nonzero(escaped)) != escapes.numel() or bool((escapes < _GAP_ESCAPE).any()):
        raise ValueError("a delta payload's gap escapes do not match its gaps")
    gaps[escaped] = escapes
    return torch.cumsum(gaps + 1, 0) - 1


def _decode_values_torch(payload: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    layout = _torch_layout(payload)
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
