"""A rank's schedule compiled into copies: for each message, its parts with their wire dtype and the strided
copies between the message buffer and the storages; packing and unpacking a message buffer; the executor's
cache of the program of its last half (``ProgramCache``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...layout.dtypes import itemsize
from ...planning.half import PlanHalf
from .copies import Copy, part_copies
from .pair_messages import Message, wire_dtype
from .schedule import Schedule, build_schedule

if TYPE_CHECKING:
    from .target_streams import Targets

__all__ = [
    "PartProgram",
    "Program",
    "ProgramCache",
    "compile_program",
    "pack",
    "payload",
    "unpack",
    "unpack_by_tensor",
    "view",
]


@dataclass(frozen=True, slots=True)
class PartProgram:
    name: str  # logical tensor name (key of sources / targets)
    wire: torch.dtype  # what the bytes on the wire are (messages.wire_dtype)
    wire_size: int
    byte_offset: int
    count: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True, slots=True)
class Program:
    """A schedule with every copy precomputed, for one rank."""

    schedule: Schedule
    sends: dict[int, list[tuple[Message, tuple[PartProgram, ...]]]]  # round -> packed messages
    receives: dict[int, list[tuple[Message, tuple[PartProgram, ...]]]]
    direct_sends: list[tuple[Message, tuple[PartProgram, ...]]]
    direct_receives: list[tuple[Message, tuple[PartProgram, ...]]]
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    local_bytes: int
    bytes_handed: dict[int, int]


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def compile_program(half: PlanHalf, schedule: Schedule) -> Program:
    def program(message: Message, side: str) -> tuple[PartProgram, ...]:
        out = []
        for part in message.parts:
            t = half.tensors[part.segment.tensor]
            wire = wire_dtype(t.source_dtype, t.target_dtype)
            copies = part_copies(part, side)
            out.append(
                PartProgram(t.name, torch_dtype(wire), itemsize(wire), part.byte_offset, part.count, copies)
            )
        return tuple(out)

    sends: dict[int, list[tuple[Message, tuple[PartProgram, ...]]]] = {}
    receives: dict[int, list[tuple[Message, tuple[PartProgram, ...]]]] = {}
    direct_sends: list[tuple[Message, tuple[PartProgram, ...]]] = []
    direct_receives: list[tuple[Message, tuple[PartProgram, ...]]] = []
    bytes_sent: dict[int, int] = {}
    bytes_received: dict[int, int] = {}
    for m in schedule.sends:
        entry = (m, program(m, "source"))
        if m.direct:
            direct_sends.append(entry)
        else:
            sends.setdefault(m.round, []).append(entry)
        bytes_sent[m.peer] = bytes_sent.get(m.peer, 0) + payload(entry[1])
    for m in schedule.receives:
        entry = (m, program(m, "target"))
        if m.direct:
            direct_receives.append(entry)
        else:
            receives.setdefault(m.round, []).append(entry)
        bytes_received[m.peer] = bytes_received.get(m.peer, 0) + payload(entry[1])
    local = [*schedule.local, *(s for _, segments in schedule.handoff_from for s in segments)]
    local_bytes = sum(s.numel * itemsize(half.tensors[s.tensor].target_dtype) for s in local)
    bytes_handed: dict[int, int] = {}
    for s in half.sends:
        if s.target_rank in schedule.handoff_to:
            n = s.numel * itemsize(half.tensors[s.tensor].target_dtype)
            bytes_handed[s.target_rank] = bytes_handed.get(s.target_rank, 0) + n
    return Program(
        schedule,
        sends,
        receives,
        direct_sends,
        direct_receives,
        bytes_sent,
        bytes_received,
        local_bytes,
        bytes_handed,
    )


def payload(parts: tuple[PartProgram, ...]) -> int:
    """Bytes a message carries on the wire (its parts in their wire dtype)."""
    return sum(p.count * p.wire_size for p in parts)


def view(storage: torch.Tensor, c: Copy) -> torch.Tensor:
    return torch.as_strided(storage, c.extent, c.strides, storage.storage_offset() + c.offset)


def pack(buf: torch.Tensor, parts: tuple[PartProgram, ...], sources: Mapping[str, torch.Tensor]) -> None:
    for p in parts:
        storage = sources[p.name]
        typed = buf[p.byte_offset : p.byte_offset + p.count * p.wire_size].view(p.wire)
        for c in p.copies:
            n = 1
            for e in c.extent:
                n *= e
            typed[c.buffer_offset : c.buffer_offset + n].view(c.extent).copy_(view(storage, c))


def unpack(buf: torch.Tensor, parts: tuple[PartProgram, ...], targets: Targets) -> None:
    for p in parts:
        storage = targets.get(p.name)
        typed = buf[p.byte_offset : p.byte_offset + p.count * p.wire_size].view(p.wire)
        for c in p.copies:
            n = 1
            for e in c.extent:
                n *= e
            view(storage, c).copy_(typed[c.buffer_offset : c.buffer_offset + n].view(c.extent))
        targets.landed(p.name)


def unpack_by_tensor(
    messages: Sequence[tuple[torch.Tensor, tuple[PartProgram, ...]]], targets: Targets
) -> None:
    """Unpack one round's messages (each a buffer and its parts) tensor by tensor across them: every part of
    a tensor in the round lands before the next tensor's first, taken in the order the messages reach them
    (a tensor's place: the smallest share of a message that comes before it). For streamed targets (loaded
    forms): peers whose rounds carry halves of the same layers (ZeRO-3 partitions, balanced replicas) would
    otherwise open every layer of a message at once, the next peer's message closing them; this way each
    closes as soon as the round's last part of it has landed."""
    place: dict[str, float] = {}
    by_tensor: dict[str, list[tuple[torch.Tensor, PartProgram]]] = {}
    for buf, parts in messages:
        for i, p in enumerate(parts):
            place[p.name] = min(place.get(p.name, 1.0), i / len(parts))
            by_tensor.setdefault(p.name, []).append((buf, p))
    for name in sorted(by_tensor, key=place.__getitem__):
        for buf, p in by_tensor[name]:
            unpack(buf, (p,), targets)


class ProgramCache:
    """The program of the last half a rank ran. Keyed by content (digest, rank, fingerprints, agreed message
    sizes, options, the kinds of its pairs), so a half rebuilt for every sync still reuses it; one plan at a
    time: a new plan replaces the old."""

    def __init__(self) -> None:
        self._cached: tuple[tuple[Any, ...], Program] | None = None

    @property
    def last(self) -> Program | None:
        return None if self._cached is None else self._cached[1]

    def get(
        self,
        half: PlanHalf,
        sizes: dict[int, int],
        fingerprints: tuple[bytes, tuple[int, int]],
        *,
        zero_copy: bool,
        depth: int,
        in_process: frozenset[int],
        shared: frozenset[int],
        pulls_from: frozenset[int],
        pulled_by: frozenset[int],
        maps_from: frozenset[int] = frozenset(),
        mapped_by: frozenset[int] = frozenset(),
    ) -> Program:
        """The program of ``half`` (``schedule.build_schedule`` with these arguments, compiled)."""
        key = (
            half.digest,
            half.rank,
            fingerprints,
            tuple(sorted(sizes.items())),
            depth,
            zero_copy,
            in_process,
            shared,
            pulls_from,
            pulled_by,
            maps_from,
            mapped_by,
        )
        cached = self._cached
        if cached is not None and cached[0] == key:
            return cached[1]
        schedule = build_schedule(
            half,
            sizes,
            zero_copy=zero_copy,
            depth=depth,
            in_process=in_process,
            shared=shared,
            pulls_from=pulls_from,
            pulled_by=pulled_by,
            maps_from=maps_from,
            mapped_by=mapped_by,
        )
        program = compile_program(half, schedule)
        self._cached = (key, program)
        return program
