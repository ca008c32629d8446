"""The messages of one pair stream: how the segments between this rank and one peer, in one direction, are
cut into messages. Pure (no torch, no process group): both ends of the pair compute the same messages from
the segments they share, so a sender's message ``k`` to rank ``t`` and rank ``t``'s message ``k`` from the
sender carry the same parts at the same byte offsets, without any exchange beyond the agreed message size.

Wire format of a pair stream (``pair_messages``):

- segments are sorted canonically (``segment_key``);
- a **direct** segment (dense in both storages, same dtype on both sides, ``zero_copy`` on, at least
  ``DIRECT_MIN_BYTES``) travels straight from source storage to target storage, no staging: it is cut into
  runs of at most ``direct_chunk_bytes(message_bytes)``, and run ``j`` of the pair is direct message ``j``
  (tag ``2j+1``). Direct messages hold no staging, so the executor posts them all at the start;
- every other segment is **packed**: the pair's packed segments are laid end to end, each part starting
  at a multiple of its element size, and cut into messages of at most ``message_bytes``. A segment that
  does not fit in the room left is cut by bytes, at an element boundary, in the row-major order of its
  extent (any axis, 1-D runs included): a run ``[start, start + count)`` of a segment is at most
  ``2·ndim − 1`` boxes, or one flat copy where the segment is dense in a storage. Packed message ``k`` of
  the pair travels in **round** ``k`` (tag ``2k``) through a staging slot. The number of rounds is about
  ``packed bytes / message_bytes``, whatever the number of segments.

Where the receiver can read the sender's memory (a same-host pair that pulls) every segment of the same
dtype on both sides whose rows are contiguous runs of at least ``PULL_MIN_RUN_BYTES`` on both sides
(``pullable``) is a direct message the receiver pulls straight from the sender's source storage; the rest
is packed like any segment.

The **wire dtype** of a packed segment (``wire_dtype``) is the narrower of its source and target floating
dtypes: a trainer's fp32 weights for a bf16 vLLM travel as bf16, half the bytes. The sender casts while
packing (``tensor.to(dtype)`` semantics, round to nearest even), the receiver copies; the result is the
same bits as a cast at the receiver. Otherwise (same size, or not both floating) it is the source dtype
and the receiver casts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...layout.dtypes import itemsize
from ...planning.half import PlanHalf
from ...planning.records import Segment

__all__ = [
    "ALIGN",
    "DIRECT_CHUNK_MIN_BYTES",
    "DIRECT_MIN_BYTES",
    "MIN_MESSAGE_BYTES",
    "PULL_MIN_RUN_BYTES",
    "Message",
    "Part",
    "direct_chunk_bytes",
    "is_dense",
    "pair_messages",
    "pullable",
    "segment_key",
    "wire_dtype",
]

ALIGN = 16
"""Message sizes and staging slots are multiples of this many bytes (so every slot starts aligned for every
dtype; a part within a message starts at a multiple of its own element size)."""

DIRECT_MIN_BYTES = 1 << 16
"""A dense segment smaller than this is packed rather than sent on its own (a message costs more than a
copy at this size)."""

MIN_MESSAGE_BYTES = 64
"""The smallest message size a staging cap may leave per peer."""

DIRECT_CHUNK_MIN_BYTES = 64 << 20
"""Direct messages are cut at ``max(message_bytes, this)``: they cost no staging, so only the number of
outstanding messages and the granularity of progress bound their size."""


PULL_MIN_RUN_BYTES = 64 << 10
"""A segment is pulled when each of its contiguous runs (rows) has at least this many bytes on both sides.
Measured (2-core EPYC): ``process_vm_readv`` moves 3.2-3.5 GB/s in runs of 64 KB and up, 1.7 GB/s in runs
of 2 KB, where a strided copy of 2 KB rows in user space moves 3.1 GB/s: short rows are packed instead."""


def direct_chunk_bytes(message_bytes: int) -> int:
    return max(message_bytes, DIRECT_CHUNK_MIN_BYTES)


@dataclass(frozen=True, slots=True)
class Part:
    """Elements ``[start, start + count)`` of a segment (row-major order of its extent), at ``byte_offset``
    in its message."""

    segment: Segment
    start: int
    count: int
    byte_offset: int


@dataclass(frozen=True, slots=True)
class Message:
    """One point-to-point message between this rank and ``peer``. A direct message has exactly one part,
    sent from the source storage and received into the target storage (``round`` is its index among the
    pair's direct messages); a packed one goes through a staging slot in round ``round``."""

    peer: int
    round: int
    direct: bool
    nbytes: int
    parts: tuple[Part, ...]

    @property
    def tag(self) -> int:
        return 2 * self.round + int(self.direct)


def segment_key(s: Segment) -> tuple[object, ...]:
    """Canonical order of segments: by tensor, then source address (locality when packing)."""
    return (
        s.tensor,
        s.source_rank,
        s.target_rank,
        s.source_offset,
        s.target_offset,
        s.extent,
        s.source_strides,
        s.target_strides,
    )


def is_dense(extent: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the row-major walk of ``extent`` visits consecutive storage elements (axes of extent 1
    ignored), so any flat run of it is one contiguous range of the storage."""
    expected = 1
    for e, s in zip(reversed(extent), reversed(strides), strict=True):
        if e == 1:
            continue
        if s != expected:
            return False
        expected *= e
    return True


_FLOATING = frozenset({"float64", "float32", "bfloat16", "float16"})


def wire_dtype(source_dtype: str, target_dtype: str) -> str:
    """The dtype a packed segment travels in: the target's when it is a narrower floating dtype (the sender
    casts), else the source's (the receiver casts)."""
    if (
        source_dtype in _FLOATING
        and target_dtype in _FLOATING
        and itemsize(target_dtype) < itemsize(source_dtype)
    ):
        return target_dtype
    return source_dtype


def _wire_size(half: PlanHalf, s: Segment) -> int:
    t = half.tensors[s.tensor]
    return itemsize(wire_dtype(t.source_dtype, t.target_dtype))


def _is_direct(half: PlanHalf, s: Segment, zero_copy: bool) -> bool:
    if not zero_copy:
        return False
    t = half.tensors[s.tensor]
    return (
        t.source_dtype == t.target_dtype
        and s.numel * itemsize(t.source_dtype) >= DIRECT_MIN_BYTES
        and is_dense(s.extent, s.source_strides)
        and is_dense(s.extent, s.target_strides)
    )


def pullable(half: PlanHalf, s: Segment) -> bool:
    """Whether the receiver of ``s`` can pull it run by run: same dtype on both sides, at least
    ``DIRECT_MIN_BYTES``, and dense on both sides or made of rows (last axis, stride 1 on both sides) of at
    least ``PULL_MIN_RUN_BYTES``."""
    t = half.tensors[s.tensor]
    size = itemsize(t.source_dtype)
    if t.source_dtype != t.target_dtype or s.numel * size < DIRECT_MIN_BYTES:
        return False
    if is_dense(s.extent, s.source_strides) and is_dense(s.extent, s.target_strides):
        return True
    return (
        bool(s.extent)
        and s.source_strides[-1] == 1
        and s.target_strides[-1] == 1
        and s.extent[-1] * size >= PULL_MIN_RUN_BYTES
    )


def pair_messages(
    half: PlanHalf,
    segments: Iterable[Segment],
    peer: int,
    message_bytes: int,
    *,
    zero_copy: bool,
    pull: bool = False,
    uniform: bool = False,
) -> list[Message]:
    """All messages of one pair stream, in round order (see the module docstring). ``segments`` are the
    segments between this rank and ``peer`` in one direction; the other end passes the same set. ``pull``:
    the receiver pulls from the sender's memory, so every ``pullable`` segment is direct. ``uniform``: a
    packed message holds parts of one wire element size only (a delta sync compares messages as arrays)."""
    if message_bytes < MIN_MESSAGE_BYTES or message_bytes % ALIGN:
        raise ValueError(
            f"message size {message_bytes} is below {MIN_MESSAGE_BYTES} or not a multiple of {ALIGN}"
        )
    ordered = sorted((s for s in segments if s.numel > 0), key=segment_key)
    packed: list[Message] = []
    direct: list[Message] = []
    parts: list[Part] = []
    used = 0

    def close() -> None:
        nonlocal parts, used
        if parts:
            packed.append(Message(peer, len(packed), False, used, tuple(parts)))
        parts, used = [], 0

    for s in ordered:
        size = _wire_size(half, s)
        n = s.numel
        if pullable(half, s) if pull else _is_direct(half, s, zero_copy):
            per = direct_chunk_bytes(message_bytes) // size
            for start in range(0, n, per):
                count = min(per, n - start)
                part = Part(s, start, count, 0)
                direct.append(Message(peer, len(direct), True, count * size, (part,)))
            continue
        if uniform and parts and _wire_size(half, parts[-1].segment) != size:
            close()
        start = 0
        while start < n:
            at = -(-used // size) * size  # typed views of the byte buffer need element alignment
            room = (message_bytes - at) // size if at < message_bytes else 0
            if room <= 0:
                close()
                continue
            count = min(room, n - start)
            parts.append(Part(s, start, count, at))
            used = at + count * size
            start += count
    close()
    return packed + direct
