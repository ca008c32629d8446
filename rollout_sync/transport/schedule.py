"""The transfer schedule of one rank's half: which bytes travel in which message, in which round.

Pure (no torch, no process group): both ends of every pair compute the same messages from the segments
they share, so a sender's message ``k`` to rank ``t`` and rank ``t``'s message ``k`` from the sender carry
the same parts at the same byte offsets, without any exchange beyond the agreed message size.

Lifecycle (see ``executor.py``): ``check_half`` (before agreement) → ``wanted_message_bytes`` (each rank's
offer, exchanged in the agreement) → ``build_schedule`` with ``message_bytes[peer] = min(offer of this
rank, offer of peer)`` → the executor runs it.

Wire format of a pair stream (one direction between two ranks):

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
  the pair travels in **round** ``k`` (tag ``2k``) through a staging slot; the executor keeps ``depth``
  rounds in flight. The number of rounds is about ``packed bytes / message_bytes``, whatever the number
  of segments.

A pair whose two ranks run in the same process (``in_process``: a trainer rank and a vLLM worker of TRL's
colocate mode) has no messages at all: its segments are a **handoff**. The sender offers its source
storages, the receiver copies each segment straight from the sender's storage into its own (one cast-copy per
element, no staging) and tells the sender when it is done.

A pair on one host in two processes (``shared``) packs its messages into staging slots that live in shared
memory (``shared_memory``), laid out per (direction, peer) segment (``shared_slots``, ``shared_bytes``)
instead of in the rank's arena. Where the receiver can read the sender's memory (``pulls_from`` /
``pulled_by``, found by a probe) every segment of the same dtype on both sides whose rows are contiguous
runs of at least ``PULL_MIN_RUN_BYTES`` on both sides (``pullable``) is a direct message the receiver pulls
straight from the sender's source storage into its target storage, run by run (``part_runs``,
``cross_memory``): one copy, no staging, no work for the sender; the rest is packed like any segment.

The **wire dtype** of a packed segment (``wire_dtype``) is the narrower of its source and target floating
dtypes: a trainer's fp32 weights for a bf16 vLLM travel as bf16, half the bytes. The sender casts while
packing (``tensor.to(dtype)`` semantics, round to nearest even), the receiver copies; the result is the
same bits as a cast at the receiver. Otherwise (same size, or not both floating) it is the source dtype
and the receiver casts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from math import prod

from ..layout.dtypes import ITEMSIZE, itemsize
from ..layout.runs import flat_run_boxes
from ..planning.plan import PlanHalf, Segment

__all__ = [
    "ALIGN",
    "DIRECT_CHUNK_MIN_BYTES",
    "DIRECT_MIN_BYTES",
    "MIN_MESSAGE_BYTES",
    "Copy",
    "Message",
    "Part",
    "Schedule",
    "build_schedule",
    "check_half",
    "direct_chunk_bytes",
    "is_dense",
    "pair_messages",
    "part_copies",
    "part_runs",
    "peers_of",
    "pullable",
    "segment_key",
    "wanted_message_bytes",
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


@dataclass(frozen=True, slots=True)
class Copy:
    """One strided copy between a storage and a message buffer: ``torch.as_strided(storage, extent,
    strides, storage_offset + offset)`` ↔ ``count`` elements of the buffer at element ``buffer_offset``
    (relative to the part's first byte), reshaped to ``extent``."""

    extent: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    buffer_offset: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """What one rank does in one sync.

    ``sends`` / ``receives`` are sorted by ``(direct, round, peer)``; ``rounds`` counts packed rounds.
    ``shared_slots`` / ``shared_bytes``: the slots of ``shared`` peers, as byte ranges in one segment per
    ``(direction, peer)``, and each segment's size.
    ``handoff_to``: the in-process peers this rank offers its sources to; ``handoff_from``: per in-process
    peer that sends to this rank, the segments this rank copies from that peer's storages (canonical order).
    ``slots`` gives each staging slot's
    byte range in the rank's staging arena, keyed by ``(direction, peer, parity)`` with direction
    ``"send"`` or ``"recv"``; packed message of round ``k`` uses parity ``k % depth``.
    """

    rank: int
    sends: tuple[Message, ...]
    receives: tuple[Message, ...]
    local: tuple[Segment, ...]
    rounds: int
    depth: int
    slots: Mapping[tuple[str, int, int], tuple[int, int]]
    staging_bytes: int
    handoff_to: tuple[int, ...] = ()
    handoff_from: tuple[tuple[int, tuple[Segment, ...]], ...] = ()
    shared_slots: Mapping[tuple[str, int, int], tuple[int, int]] = field(default_factory=dict)
    shared_bytes: Mapping[tuple[str, int], int] = field(default_factory=dict)

    def slot(self, direction: str, message: Message) -> tuple[int, int]:
        """The byte range of ``message``'s slot: in the arena, or in its pair's shared segment."""
        key = (direction, message.peer, message.round % self.depth)
        found = self.slots.get(key)
        return found if found is not None else self.shared_slots[key]


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


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def peers_of(
    half: PlanHalf, in_process: frozenset[int] = frozenset()
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks this half sends messages to, and those it receives messages from (sorted); peers in
    ``in_process`` are left out (their segments are handoffs, not messages)."""
    return (
        tuple(sorted({s.target_rank for s in half.sends} - in_process)),
        tuple(sorted({s.source_rank for s in half.receives} - in_process)),
    )


def wanted_message_bytes(
    half: PlanHalf, staging_cap_bytes: int, depth: int, in_process: frozenset[int] = frozenset()
) -> int:
    """The largest message this rank can stage per peer: ``cap / (depth · (send peers + receive peers))``,
    rounded down to ``ALIGN``. ``depth`` is 2 when packing the next round overlaps the current transfer."""
    send_peers, recv_peers = peers_of(half, in_process)
    slots = depth * (len(send_peers) + len(recv_peers))
    return _align_down(staging_cap_bytes // max(slots, 1))


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


def part_runs(part: Part) -> list[tuple[int, int, int]]:
    """The contiguous runs of a pulled part: ``(source element offset, target element offset, count)``,
    one for a part dense on both sides, else one per row of each box of the part."""
    s = part.segment
    if is_dense(s.extent, s.source_strides) and is_dense(s.extent, s.target_strides):
        return [(s.source_offset + part.start, s.target_offset + part.start, part.count)]
    runs = []
    for box in flat_run_boxes(s.extent, part.start, part.start + part.count):
        lead = box.extent[:-1]
        for index in product(*(range(o, o + e) for o, e in zip(box.origin[:-1], lead, strict=True))):
            at = (*index, box.origin[-1])
            src = s.source_offset + sum(i * st for i, st in zip(at, s.source_strides, strict=True))
            dst = s.target_offset + sum(i * st for i, st in zip(at, s.target_strides, strict=True))
            runs.append((src, dst, box.extent[-1]))
    return runs


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


def build_schedule(
    half: PlanHalf,
    message_bytes: Mapping[int, int],
    *,
    zero_copy: bool = True,
    depth: int = 2,
    in_process: frozenset[int] = frozenset(),
    shared: frozenset[int] = frozenset(),
    pulls_from: frozenset[int] = frozenset(),
    pulled_by: frozenset[int] = frozenset(),
    uniform: bool = False,
) -> Schedule:
    """The schedule of ``half`` given the agreed message size with each peer; segments with a peer in
    ``in_process`` become handoffs; peers in ``shared`` get shared slots, and direct messages only where
    this rank pulls from them (``pulls_from``) or they pull from it (``pulled_by``); ``uniform``: one wire
    element size per packed message (``pair_messages``)."""
    if depth not in (1, 2):
        raise ValueError(f"depth must be 1 or 2, not {depth}")
    by_peer_out: dict[int, list[Segment]] = {}
    by_peer_in: dict[int, list[Segment]] = {}
    handoff_in: dict[int, list[Segment]] = {}
    handoff_to: set[int] = set()
    for s in half.sends:
        if s.target_rank in in_process:
            handoff_to.add(s.target_rank)
        else:
            by_peer_out.setdefault(s.target_rank, []).append(s)
    for s in half.receives:
        if s.source_rank in in_process:
            handoff_in.setdefault(s.source_rank, []).append(s)
        else:
            by_peer_in.setdefault(s.source_rank, []).append(s)
    sends: list[Message] = []
    receives: list[Message] = []
    slot_sizes: dict[tuple[str, int, int], int] = {}
    for direction, by_peer, out in (("send", by_peer_out, sends), ("recv", by_peer_in, receives)):
        for peer in sorted(by_peer):
            pulls = pulled_by if direction == "send" else pulls_from
            direct = zero_copy and peer not in shared
            msgs = pair_messages(
                half,
                by_peer[peer],
                peer,
                message_bytes[peer],
                zero_copy=direct,
                pull=zero_copy and peer in pulls,
                uniform=uniform,
            )
            out.extend(msgs)
            for m in msgs:
                if not m.direct:
                    key = (direction, peer, m.round % depth)
                    slot_sizes[key] = max(slot_sizes.get(key, 0), _align_up(m.nbytes))
    order = lambda m: (m.direct, m.round, m.peer)  # noqa: E731
    sends.sort(key=order)
    receives.sort(key=order)
    slots: dict[tuple[str, int, int], tuple[int, int]] = {}
    shared_slots: dict[tuple[str, int, int], tuple[int, int]] = {}
    shared_bytes: dict[tuple[str, int], int] = {}
    offset = 0
    for key in sorted(slot_sizes):
        direction, peer, _ = key
        if peer in shared:
            at = shared_bytes.get((direction, peer), 0)
            shared_slots[key] = (at, slot_sizes[key])
            shared_bytes[(direction, peer)] = at + slot_sizes[key]
            continue
        slots[key] = (offset, slot_sizes[key])
        offset += slot_sizes[key]
    rounds = max((m.round + 1 for m in (*sends, *receives) if not m.direct), default=0)
    return Schedule(
        rank=half.rank,
        sends=tuple(sends),
        receives=tuple(receives),
        local=tuple(sorted(half.local, key=segment_key)),
        rounds=rounds,
        depth=depth,
        slots=slots,
        staging_bytes=offset,
        handoff_to=tuple(sorted(handoff_to)),
        shared_slots=shared_slots,
        shared_bytes=shared_bytes,
        handoff_from=tuple(
            (peer, tuple(sorted(segments, key=segment_key))) for peer, segments in sorted(handoff_in.items())
        ),
    )


def part_copies(part: Part, side: str) -> tuple[Copy, ...]:
    """The strided copies that move ``part`` between its message and the ``"source"`` or ``"target"``
    storage: one flat copy where the segment is dense in that storage, else one per box of the run (at
    most ``2·ndim − 1``)."""
    s = part.segment
    if side == "source":
        base, strides = s.source_offset, s.source_strides
    elif side == "target":
        base, strides = s.target_offset, s.target_strides
    else:
        raise ValueError(f"side must be 'source' or 'target', not {side!r}")
    if is_dense(s.extent, strides):
        return (Copy((part.count,), (1,), base + part.start, 0),)
    copies = []
    position = 0
    for box in flat_run_boxes(s.extent, part.start, part.start + part.count):
        offset = base + sum(o * st for o, st in zip(box.origin, strides, strict=True))
        copies.append(Copy(box.extent, strides, offset, position))
        position += box.numel
    return tuple(copies)


def _reach(offset: int, extent: Sequence[int], strides: Sequence[int]) -> int:
    """One past the last storage element a view touches (``offset`` for an empty view)."""
    if prod(extent) == 0:
        return offset
    return offset + sum((e - 1) * st for e, st in zip(extent, strides, strict=True)) + 1


def check_half(half: PlanHalf) -> str | None:
    """Why this half cannot be executed by its rank, or None. Checks only what the half itself says
    (segment roles, addresses inside the storage shapes of the plan's tensor table, known dtypes); the
    local storages are checked by the executor."""
    rank = half.rank
    n = len(half.tensors)
    for t in half.tensors:
        for dtype in (t.source_dtype, t.target_dtype):
            if dtype not in ITEMSIZE:
                return f"tensor {t.name!r} has dtype {dtype!r}, which the transport does not know"
    roles = (
        ("sent", half.sends, lambda s: s.source_rank == rank != s.target_rank),
        ("received", half.receives, lambda s: s.target_rank == rank != s.source_rank),
        ("local", half.local, lambda s: s.source_rank == rank == s.target_rank),
    )
    for role, segments, belongs in roles:
        for s in segments:
            if not 0 <= s.tensor < n:
                return f"a {role} segment names tensor index {s.tensor}, the plan has {n} tensors"
            t = half.tensors[s.tensor]
            where = f"tensor {t.name!r}, {role} segment {s.source_rank}->{s.target_rank} extent {s.extent}"
            if not belongs(s):
                return f"{where} does not belong to the {role} segments of rank {rank}"
            if len(s.source_strides) != len(s.extent) or len(s.target_strides) != len(s.extent):
                return f"{where}: strides {s.source_strides}/{s.target_strides} do not match the extent"
            if any(e < 0 for e in s.extent) or min((*s.source_strides, *s.target_strides, 0)) < 0:
                return f"{where}: negative extent or stride"
            if s.source_offset < 0 or s.target_offset < 0:
                return f"{where}: negative offset"
            sides = []
            if role in ("sent", "local"):
                sides.append(("source", t.source_storage, s.source_rank, s.source_offset, s.source_strides))
            if role in ("received", "local"):
                sides.append(("target", t.target_storage, s.target_rank, s.target_offset, s.target_strides))
            for side, storages, owner, offset, strides in sides:
                shape = storages.get(owner)
                if shape is None:
                    return f"{where}: the plan lists no {side} storage on rank {owner}"
                reach = _reach(offset, s.extent, strides)
                if reach > prod(shape):
                    return (
                        f"{where}: reaches {side} element {reach - 1}, the {side} storage on rank {owner}"
                        f" has shape {tuple(shape)} ({prod(shape)} elements)"
                    )
    return None
