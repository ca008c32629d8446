"""Delta sync: each sender sends only the elements that changed since the last sync it committed.

**What a sender compares.** A delta sync runs the rank's half as a schedule in which every segment is packed
(no direct messages, no shared slots, one element size per message: ``DeltaProgram``), with the message
sizes the agreement gave. The
sender packs each message as a full sync would (cast to the wire dtype, so a change is a change of what the
receiver holds) and compares it, bit for bit, with the same message as it last sent it: its **shadow**, one
byte buffer per rank holding every message it sends, laid end to end (``DeltaProgram.shadow_at``). The
shadow costs the bytes this rank sends per sync (``shadow_bytes``), once, on the sender only; it is kept only
where ``ExecuteOptions.delta`` is on.

**What travels.** Per message, a 16-byte head (int64 mode and payload bytes) and, unless nothing changed, a
payload: the changes coded by ``delta_codec`` when at most ``1/MAX_CHANGED_SHARE`` of its elements changed
(the positions then cost less than the values they spare), else the whole message as a full sync would send
it. The head of round ``k`` has tag
``2k + 1``, the payload ``2k``. Segments between ranks of one process (handoffs) and within a rank are
copied whole, as in a full sync: they are memory copies.

**What a receiver does.** For a coded message it finds where each changed element lands (``Landing``: the
message's copies as tables, a binary search and an unravel per element), reads the old values there (the
receiver holds the base version: the agreement checked it), decodes the new ones and writes them. A whole
message is unpacked as in a full sync.

**When.** Every rank puts its base in the agreement record: the version of the last sync it committed under
the same plan and message sizes, with its storages untouched since (a receiver whose targets are streamed
cannot: a layer's loaded form does not outlive its sync). A delta sync runs only when every rank names the
same base under the layout agreed now (``agreement.delta_base``); anything else (a first sync, a failed or
refused one, a new executor after a re-handshake, a restarted engine, another plan) is a full sync, which
refills the shadow. Each rank forgets its base when a sync starts and gets it back only from ``committed``.

**Falling back.** A sender also keeps a sample of what it sent (every ``SAMPLE_STRIDE``-th element of each
source storage, in the wire dtype). Before the agreement it compares the sample with its sources; when more
than ``FALLBACK_SHARE`` changed it names no base, so the sync is full, and it does not refill its shadow
(the next sync is then full too, and refills it if its sample says that one is worth a delta).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import WireFormatError
from ..planning.plan import PlanHalf
from .delta_codec import (
    bits_dtype,
    changed_positions,
    decode_positions,
    decode_values,
    encode,
    max_encoded_bytes,
)
from .p2p import Op, Pending, Transport
from .program import PartProgram, Program, pack, torch_dtype, unpack
from .schedule import Message, wire_dtype
from .targets import Targets

__all__ = [
    "FALLBACK_SHARE",
    "MAX_CHANGED_SHARE",
    "SAMPLE_STRIDE",
    "DeltaCounts",
    "DeltaProgram",
    "Landing",
    "Shadow",
    "changed_share",
    "layout_key",
    "message_itemsize",
    "run_delta",
    "take_sample",
]

MAX_CHANGED_SHARE = 32
"""A message is coded when at most 1/32 of its elements changed, else sent whole. Bytes alone would code up
to about 85% changed (2.3 bytes per changed bf16 element against 2 per element), but coding and applying
cost about 100-200 ns per changed element on this 2-core CPU (against about 1.5 ns per element for a whole
message over loopback gloo): past a few percent a whole message is faster here."""

FALLBACK_SHARE = 1 / MAX_CHANGED_SHARE
"""The default of ``ExecuteOptions.delta_full_above``: a sender whose sample says more than this share of
what it sends changed asks for a full sync. Nearly every message would travel whole, and a full sync moves
those bytes with fewer copies (direct messages, no shadow to compare or update)."""

SAMPLE_STRIDE = 1024
"""The sample a sender keeps: every 1024th element of each source storage it sends from (denser in small
ones)."""

NONE, CODED, WHOLE = 0, 1, 2


def layout_key(digest: str, offers: list[int], depth: int) -> bytes:
    """What fixes every message of every rank: the plan, the agreed message offers and the depth. The same
    on every rank after the agreement."""
    text = f"{digest}|{depth}|{','.join(str(o) for o in offers)}"
    return hashlib.sha256(text.encode()).digest()[:8]


def message_itemsize(parts: tuple[PartProgram, ...]) -> int | None:
    """The element size shared by every part of a message (its parts then tile it with no gap), else None."""
    sizes = {p.wire_size for p in parts}
    return sizes.pop() if len(sizes) == 1 else None


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


@dataclass
class DeltaProgram:
    """The all-packed program a delta sync runs, the sender's shadow layout, the receiver's landings."""

    program: Program
    layout: bytes
    shadow_at: dict[tuple[int, int], int]  # (peer, round) of a send message -> its byte offset in the shadow
    shadow_bytes: int
    landings: dict[tuple[int, int], Landing] = field(default_factory=dict)

    @classmethod
    def of(cls, program: Program, layout: bytes) -> DeltaProgram:
        at: dict[tuple[int, int], int] = {}
        total = 0
        for entries in program.sends.values():
            for m, parts in entries:
                if message_itemsize(parts) is not None:
                    at[(m.peer, m.round)] = total
                    total += -(-m.nbytes // 8) * 8
        return cls(program, layout, at, total)

    def landing(self, m: Message, parts: tuple[PartProgram, ...], itemsize: int) -> Landing:
        key = (m.peer, m.round)
        found = self.landings.get(key)
        if found is None:
            found = self.landings[key] = Landing.of(parts, itemsize)
        return found


class Shadow:
    """What this rank last sent in every message of a delta program (see the module docstring)."""

    def __init__(self, delta: DeltaProgram, device: torch.device) -> None:
        self.layout = delta.layout
        self.buffer = torch.zeros(delta.shadow_bytes, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def of(self, delta: DeltaProgram, m: Message) -> torch.Tensor:
        at = delta.shadow_at[(m.peer, m.round)]
        return self.buffer[at : at + m.nbytes]

    def refill(self, delta: DeltaProgram, sources: Mapping[str, torch.Tensor]) -> None:
        """Pack every message into the shadow (after a full sync: what it sent)."""
        for entries in delta.program.sends.values():
            for m, parts in entries:
                if (m.peer, m.round) in delta.shadow_at:
                    pack(self.of(delta, m), parts, sources)


def _sampled_names(half: PlanHalf) -> dict[str, torch.dtype]:
    """The source storages this rank sends from, with the dtype each travels in."""
    out = {}
    for segment in half.sends:
        t = half.tensors[segment.tensor]
        out[t.name] = torch_dtype(wire_dtype(t.source_dtype, t.target_dtype))
    return out


def take_sample(half: PlanHalf, sources: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ``SAMPLE_STRIDE``-th element of each contiguous source storage this rank sends from, cast to the
    dtype it travels in (a change is a change of what the receiver holds)."""
    return {
        name: _sampled(sources[name]).to(wire).clone()
        for name, wire in _sampled_names(half).items()
        if sources[name].is_contiguous()
    }


def _sampled(storage: torch.Tensor) -> torch.Tensor:
    """Every ``SAMPLE_STRIDE``-th element of a contiguous storage, denser in small ones (at least 64 samples
    where it has them): a view."""
    return storage.view(-1)[:: max(1, min(SAMPLE_STRIDE, storage.numel() // 64))]


def changed_share(
    sample: Mapping[str, torch.Tensor], half: PlanHalf, sources: Mapping[str, torch.Tensor]
) -> float:
    """The share of the sampled elements whose bits differ from ``sample`` (taken at the last sync)."""
    changed = total = 0
    for name, old in sample.items():
        new = _sampled(sources[name]).to(old.dtype)
        bits = bits_dtype(old.element_size())
        changed += int(torch.count_nonzero(new.view(bits) != old.view(bits)))
        total += old.numel()
    return changed / total if total else 0.0


@dataclass
class DeltaCounts:
    """What one delta sync did on one rank: payload bytes per peer (heads included), and, as a sender, how
    many elements it compared and how many of them had changed."""

    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    compared: int = 0
    changed: int = 0
    messages_sent: int = 0
    messages_received: int = 0


def _flat(storage: torch.Tensor) -> torch.Tensor:
    """Every element of ``storage``'s memory from its own offset on, as one flat tensor."""
    span = storage.untyped_storage().nbytes() // storage.element_size() - storage.storage_offset()
    return torch.as_strided(storage, (span,), (1,), storage.storage_offset())


def _apply(payload: torch.Tensor, landing: Landing, targets: Targets, elements: int) -> int:
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


def run_delta(
    delta: DeltaProgram,
    shadow: Shadow,
    slot: Callable[[str, Message], torch.Tensor],
    sources: Mapping[str, torch.Tensor],
    targets: Targets,
    transport: Transport,
    add: Callable[[str, float], float],
) -> DeltaCounts:
    """The messages of a delta sync, round by round: a sender packs, compares with its shadow, sends head
    and payload (and updates its shadow); a receiver takes each head, then its payload, and applies it.
    ``slot(direction, message)``: the message's staging slot; ``add(phase, since)``: the phase clock."""
    program = delta.program
    depth = program.schedule.depth
    counts = DeltaCounts()
    heads_in: dict[tuple[int, int], torch.Tensor] = {}
    head_waits: dict[tuple[int, int], Pending] = {}
    t = time.perf_counter()
    for entries in program.receives.values():
        for m, _ in entries:
            head = torch.zeros(2, dtype=torch.int64)
            heads_in[(m.peer, m.round)] = head
            (head_waits[(m.peer, m.round)],) = transport.post(
                [Op("recv", head, m.peer, 2 * m.round + 1, f"delta head {m.round}")]
            )
    t = add("post", t)
    sent: dict[int, list[Pending]] = {}
    keep: list[torch.Tensor] = []  # heads on the wire

    def send(m: Message, parts: tuple[PartProgram, ...]) -> None:
        nonlocal t
        buf = slot("send", m)
        pack(buf, parts, sources)
        t = add("pack", t)
        itemsize = message_itemsize(parts)
        mode, payload = WHOLE, buf
        if itemsize is not None:
            bits = bits_dtype(itemsize)
            new = buf.view(bits)
            old = shadow.of(delta, m).view(bits)
            counts.compared += new.numel()
            changed, positions = changed_positions(new, old, new.numel() // MAX_CHANGED_SHARE)
            counts.changed += changed
            t = add("compare", t)
            if positions is None or max_encoded_bytes(changed, itemsize) > buf.numel():
                old.copy_(new)
            elif changed == 0:
                mode, payload = NONE, buf[:0]
            else:
                values = new.index_select(0, positions)
                nbytes = encode(new, old, positions, buf, values)
                old.index_copy_(0, positions, values)
                mode, payload = CODED, buf[:nbytes]
        t = add("code", t)
        head = torch.tensor([mode, payload.numel()], dtype=torch.int64)
        keep.append(head)
        ops = [Op("send", head, m.peer, 2 * m.round + 1, f"delta head {m.round}")]
        if mode != NONE:
            ops.append(Op("send", payload, m.peer, 2 * m.round, f"delta round {m.round}"))
        sent.setdefault(m.round, []).extend(transport.post(ops))
        counts.bytes_sent[m.peer] = counts.bytes_sent.get(m.peer, 0) + 16 + payload.numel()
        counts.messages_sent += len(ops)
        t = add("post", t)

    def receive(round_: int) -> None:
        nonlocal t
        entries = program.receives.get(round_, ())
        posted: list[tuple[Message, tuple[PartProgram, ...], int, torch.Tensor, Pending]] = []
        for m, parts in entries:
            transport.wait([head_waits.pop((m.peer, m.round))])
            mode, nbytes = (int(v) for v in heads_in.pop((m.peer, m.round)))
            counts.bytes_received[m.peer] = counts.bytes_received.get(m.peer, 0) + 16 + nbytes
            counts.messages_received += 1
            if mode == NONE:
                continue
            if (
                mode not in (CODED, WHOLE)
                or not 0 < nbytes <= m.nbytes
                or (mode == WHOLE and nbytes != m.nbytes)
            ):
                raise WireFormatError(
                    f"rank {transport.rank}: rank {m.peer} sent a delta head (mode {mode}, {nbytes} bytes) that "
                    f"does not fit message {m.round} ({m.nbytes} bytes)"
                )
            buf = slot("recv", m)[:nbytes]
            (pending,) = transport.post([Op("recv", buf, m.peer, 2 * m.round, f"delta round {m.round}")])
            counts.messages_received += 1
            posted.append((m, parts, mode, buf, pending))
        t = add("post", t)
        for m, parts, mode, buf, pending in posted:
            transport.wait([pending])
            t = add("wait", t)
            if mode == WHOLE:
                unpack(buf, parts, targets)
            else:
                itemsize = message_itemsize(parts)
                if itemsize is None:
                    raise WireFormatError(
                        f"rank {transport.rank}: rank {m.peer} coded a message of mixed dtypes"
                    )
                try:
                    _apply(buf, delta.landing(m, parts, itemsize), targets, m.nbytes // itemsize)
                except ValueError as e:
                    raise WireFormatError(
                        f"rank {transport.rank}: message {m.round} from rank {m.peer}: {e}"
                    ) from e
                for p in parts:
                    targets.landed(p.name)
            t = add("unpack", t)

    for r in range(program.schedule.rounds):
        if r >= depth:
            transport.wait(sent.pop(r - depth, []))  # its slots are reused now
            t = add("wait", t)
        for m, parts in program.sends.get(r, ()):
            send(m, parts)
        receive(r)
    for r in sorted(sent):
        transport.wait(sent.pop(r))
    add("wait", t)
    return counts
