"""Fingerprints of a half that let ranks check, with a few fixed-size numbers each, that their halves fit
together. Pure.

- ``table_hash``: the plan's tensor table (names, shapes, dtypes, storage shapes on every rank). Every
  rank holds the whole table, so every rank must report the same hash.
- ``pair_sums``: the sum (mod 2⁶⁴) of a hash of every segment this rank sends, and the same over every
  segment it receives. Summed over all ranks, the two totals are equal when every sent segment is
  received by its target and nothing else is (up to a 2⁻⁶⁴ collision), so a half that lost or gained a
  segment is caught before any byte moves, even when its digest string was copied from the right plan.
"""

from __future__ import annotations

import hashlib

from ...planning.half import PlanHalf
from ...planning.records import PlannedTensor, Segment

__all__ = ["MASK64", "pair_sums", "segment_hash", "table_hash"]

MASK64 = (1 << 64) - 1


def _tensor_text(t: PlannedTensor) -> str:
    return repr(
        (
            t.name,
            tuple(t.shape),
            t.source_dtype,
            t.target_dtype,
            tuple(sorted((r, tuple(s)) for r, s in t.source_storage.items())),
            tuple(sorted((r, tuple(s)) for r, s in t.target_storage.items())),
        )
    )


def table_hash(half: PlanHalf) -> bytes:
    """16 bytes identifying the plan's tensor table."""
    h = hashlib.blake2b(digest_size=16)
    for t in half.tensors:
        h.update(_tensor_text(t).encode())
        h.update(b"\n")
    return h.digest()


def segment_hash(s: Segment) -> int:
    text = repr(
        (
            s.tensor,
            s.source_rank,
            s.source_offset,
            tuple(s.source_strides),
            s.target_rank,
            s.target_offset,
            tuple(s.target_strides),
            tuple(s.extent),
        )
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def pair_sums(half: PlanHalf) -> tuple[int, int]:
    """(sum of hashes of sent segments, sum of hashes of received segments), each mod 2⁶⁴."""
    sent = sum(segment_hash(s) for s in half.sends) & MASK64
    received = sum(segment_hash(s) for s in half.receives) & MASK64
    return sent, received
