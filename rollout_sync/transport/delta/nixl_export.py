"""Delta syncs without a group (backend ``nixl``): a trainer rank codes what changed for each of its readers into
one registered **export** buffer; a reader whose base matches reads its region whole and applies it. No NIXL
import here: the endpoints (``sync.nixl_source``, ``sync.nixl_pull``) move the bytes.

**Messages.** Both sides compile the all-packed program of their half (``delta_program``: one wire element size
per message, every message at most the trainer rank's message size, given in its hello), as the group path's
delta sync does (``delta``). A trainer rank's messages to reader *r* are then *r*'s messages from it, in the
same order: both come from one plan.

**Export layout.** A table of ``TABLE_ROWS`` rows of five int64 (reader rank, sequence number, base sequence,
byte offset, bytes; rank -1: an empty row), then the regions. Reader *r*'s region: one head per message (mode
and payload bytes, two int64 each), in program order, then the payloads end to end, each at a multiple of 8.

**Per sync**, before it says READY, a trainer rank first compares a sample of its sources with the last sync's
(``delta.shadow``): where more than ``ExecuteOptions.delta_full_above`` changed, no reader gets a row and the
shadows are left as they are (the next sync is full too). Otherwise it codes, for each reader it has messages for, every message
against its shadow (``delta.run.code_message``: the shadow then holds this sync's values) into the reader's
region. The row's base is the sync (its sequence number) the shadow held for that reader before: versions
may repeat (a sync without a step), sequence numbers do not. A reader new to the trainer
rank (its first sync, or one that joined later through the admission desk: its messages are not in the
trainer rank's half) gets no row, and neither does a region that does not fit what is left of the export; the
shadow of its messages is refilled (packed) instead.

A reader applies a delta only when every trainer rank it reads from has a row for it in this sync with the base it
committed last (``PullEndpoint`` forgets its base whenever something else writes its targets); otherwise it
reads its whole half. Either way its targets then equal the trainer ranks' shadows, the base of the next sync.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from ...errors import WireFormatError
from ...planning.half import PlanHalf
from ..core.pair_messages import Message
from ..core.program import PartProgram, compile_program, pack
from ..core.schedule import build_schedule, peers_of
from ..core.target_streams import Targets
from .packed_program import DeltaProgram, layout_key
from .run import NONE, WHOLE, DeltaCounts, apply_message, check_head, code_message
from .shadow import Shadow, changed_share, take_sample

__all__ = [
    "TABLE_BYTES",
    "DeltaExport",
    "ExportRow",
    "apply_region",
    "delta_program",
    "export_buffer",
    "read_table",
]

TABLE_ROWS = 1024
ROW_INTS = 5
TABLE_BYTES = TABLE_ROWS * ROW_INTS * 8
HEAD_BYTES = 16


def _align8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True, slots=True)
class ExportRow:
    """A reader's region in a trainer rank's export for sync ``seq``: coded against sync ``base``."""

    rank: int
    seq: int
    base: int
    offset: int
    nbytes: int


def delta_program(half: PlanHalf, message_bytes: int) -> DeltaProgram:
    """The all-packed program of ``half`` with every peer's messages at most ``message_bytes``."""
    send_peers, recv_peers = peers_of(half)
    sizes = {p: message_bytes for p in {*send_peers, *recv_peers}}
    schedule = build_schedule(half, sizes, zero_copy=False, depth=1, uniform=True)
    return DeltaProgram.of(compile_program(half, schedule), layout_key(half.digest, [message_bytes], 1))


def _by_peer(
    entries: Mapping[int, list[tuple[Message, tuple[PartProgram, ...]]]],
) -> dict[int, list[tuple[Message, tuple[PartProgram, ...]]]]:
    out: dict[int, list[tuple[Message, tuple[PartProgram, ...]]]] = {}
    for r in sorted(entries):
        for m, parts in entries[r]:
            out.setdefault(m.peer, []).append((m, parts))
    return out


def read_table(buffer: torch.Tensor) -> dict[int, ExportRow]:
    """The rows of an export table (its first ``TABLE_BYTES`` bytes), by reader rank."""
    rows = buffer[:TABLE_BYTES].view(torch.int64).view(TABLE_ROWS, ROW_INTS).tolist()
    return {int(r[0]): ExportRow(*(int(v) for v in r)) for r in rows if r[0] >= 0}


def export_buffer(capacity: int) -> torch.Tensor:
    """An export: an empty table, then ``capacity`` bytes of regions."""
    buffer = torch.zeros(TABLE_BYTES + capacity, dtype=torch.uint8)
    buffer[:TABLE_BYTES].view(torch.int64).view(TABLE_ROWS, ROW_INTS)[:, 0] = -1
    return buffer


class DeltaExport:
    """A trainer rank's side: its program, shadow and export buffer (``export_buffer``, registered)."""

    def __init__(
        self, half: PlanHalf, message_bytes: int, buffer: torch.Tensor, full_above: float = 1 / 32
    ) -> None:
        self.half = half
        self.full_above = full_above
        # a sample of the sources at the last sync (``delta.shadow``), and this sync's changed share by it
        self.sample: dict[str, torch.Tensor] | None = None
        self.share: float | None = None
        self.delta = delta_program(half, message_bytes)
        self.messages = _by_peer(self.delta.program.sends)
        self.shadow = Shadow(self.delta, torch.device("cpu"))
        self.buffer = buffer
        self.table = self.buffer[:TABLE_BYTES].view(torch.int64).view(TABLE_ROWS, ROW_INTS)
        self.table[:, 0] = -1
        largest = max((m.nbytes for msgs in self.messages.values() for m, _ in msgs), default=0)
        self.spare = torch.empty(largest, dtype=torch.uint8)  # a message coded where the export has no room
        self.held: dict[int, int] = {}  # reader rank -> the sync (sequence number) its messages' shadow holds

    def code(self, sources: Mapping[str, torch.Tensor], readers: Collection[int], seq: int) -> DeltaCounts:
        """Code sync ``seq`` for ``readers`` (ranks) into the export (see the module docstring)."""
        counts = DeltaCounts()
        self.table[:, 0] = -1
        self.share = None if self.sample is None else changed_share(self.sample, self.half, sources)
        self.sample = take_sample(self.half, sources)
        if self.share is not None and self.share > self.full_above:
            # most of it changed: every reader reads its whole half, and neither coding nor refilling the
            # shadows pays (the next sync is full too, and refills them if its sample says a delta will pay)
            self.held.clear()
            return counts
        at, row = TABLE_BYTES, 0
        end = self.buffer.numel()
        for peer, msgs in self.messages.items():
            if peer not in readers:
                self.held.pop(peer, None)  # it left: it comes back (if ever) as a new reader
                continue
            base = self.held.pop(peer, -1)
            fits = base >= 0 and row < TABLE_ROWS and at + HEAD_BYTES * len(msgs) <= end
            heads: list[tuple[int, int]] = []
            payload_at = at + HEAD_BYTES * len(msgs)
            for m, parts in msgs:
                if not fits:
                    pack(self.shadow.of(self.delta, m), parts, sources)
                    continue
                room = end - payload_at
                buf = (
                    self.buffer[payload_at : payload_at + m.nbytes]
                    if room >= m.nbytes
                    else self.spare[: m.nbytes]
                )
                mode, nbytes = code_message(self.delta, self.shadow, m, parts, sources, buf, counts)
                if payload_at + nbytes > end:
                    fits = False  # this message's shadow is updated; the others are refilled
                    continue
                if buf.data_ptr() == self.spare.data_ptr() and nbytes:
                    self.buffer[payload_at : payload_at + nbytes].copy_(buf[:nbytes])
                heads.append((mode, nbytes))
                payload_at += _align8(nbytes)
                counts.bytes_sent[peer] = counts.bytes_sent.get(peer, 0) + HEAD_BYTES + nbytes
            self.held[peer] = seq
            if fits:
                head_view = self.buffer[at : at + HEAD_BYTES * len(msgs)].view(torch.int64)
                head_view.copy_(torch.tensor(heads, dtype=torch.int64).view(-1))
                self.table[row] = torch.tensor([peer, seq, base, at, payload_at - at], dtype=torch.int64)
                row += 1
                at = payload_at
            else:
                counts.bytes_sent.pop(peer, None)
        return counts


def apply_region(
    delta: DeltaProgram,
    source: int,
    region: torch.Tensor,
    targets: Targets,
    rank: int,
) -> tuple[set[str], set[str]]:
    """A reader's side: apply the region trainer rank ``source`` coded for it (its messages from ``source``
    in program order); the targets that came with no change, and those written."""
    msgs = _by_peer(delta.program.receives).get(source, [])
    heads_bytes = HEAD_BYTES * len(msgs)
    if region.numel() < heads_bytes:
        raise WireFormatError(
            f"rank {rank}: trainer rank {source}'s delta region has {region.numel()} bytes, less than its "
            f"{len(msgs)} heads"
        )
    heads = region[:heads_bytes].view(torch.int64).view(-1, 2).tolist()
    quiet: set[str] = set()
    touched: set[str] = set()
    at = heads_bytes
    for (m, parts), (mode, nbytes) in zip(msgs, heads, strict=True):
        check_head(m, int(mode), int(nbytes), rank)
        if mode == NONE:
            quiet.update(p.name for p in parts)
            continue
        if at + nbytes > region.numel():
            raise WireFormatError(
                f"rank {rank}: trainer rank {source}'s delta region ends before message {m.round}'s payload"
            )
        if mode == WHOLE:
            touched.update(p.name for p in parts)
        else:  # the targets the changes land in are touched (``apply_changes``)
            quiet.update(p.name for p in parts)
        apply_message(delta, m, parts, int(mode), region[at : at + nbytes], targets, touched, rank)
        at += _align8(int(nbytes))
    return quiet - touched, touched
