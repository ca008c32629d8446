"""The messages of one delta sync (``delta``), round by round: a sender packs each message, compares it with
its shadow and sends a head (mode and payload bytes) and, unless nothing changed, a payload (the coded
changes or the whole message), updating its shadow; a receiver takes each head, then its payload, and
applies it (``delta.landing``) or unpacks it whole. A receiver notes the targets whose every message came
with no change (``DeltaCounts.quiet``): their storages hold what they held, so what is derived from them
(a kernel's form, a derived copy) need not be rebuilt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ...errors import WireFormatError
from ..core.p2p import Op, Pending, Transport
from ..core.pair_messages import Message
from ..core.program import PartProgram, pack, unpack
from ..core.target_streams import Targets
from .change_codec import bits_dtype, changed_positions, encode, encode_changes, max_encoded_bytes
from .compare import Run, find_changes
from .landing import apply_changes
from .packed_program import MAX_CHANGED_SHARE, DeltaProgram, message_itemsize
from .shadow import Shadow, message_runs

__all__ = ["DeltaCounts", "apply_message", "check_head", "code_message", "run_delta"]

NONE, CODED, WHOLE = 0, 1, 2


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
    quiet: set[str] = field(default_factory=set)
    """As a receiver: the targets whose every delta message came with no change (mode NONE)."""


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
    quiet: set[str] = set()  # targets of messages that came with no change
    touched: set[str] = set()  # targets of messages that came with changes (or whole)

    def send(m: Message, parts: tuple[PartProgram, ...]) -> None:
        nonlocal t

        def tick(phase: str) -> None:
            nonlocal t
            t = add(phase, t)

        buf = slot("send", m)
        mode, nbytes = code_message(delta, shadow, m, parts, sources, buf, counts, tick)
        payload = buf[:nbytes]
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
            check_head(m, mode, nbytes, transport.rank)
            if mode == NONE:
                quiet.update(p.name for p in parts)
                continue
            if mode == WHOLE:
                touched.update(p.name for p in parts)
            else:  # the parts the changes land in are touched (``apply_changes``)
                quiet.update(p.name for p in parts)
            buf = slot("recv", m)[:nbytes]
            (pending,) = transport.post([Op("recv", buf, m.peer, 2 * m.round, f"delta round {m.round}")])
            counts.messages_received += 1
            posted.append((m, parts, mode, buf, pending))
        t = add("post", t)
        for m, parts, mode, buf, pending in posted:
            transport.wait([pending])
            t = add("wait", t)
            apply_message(delta, m, parts, mode, buf, targets, touched, transport.rank)
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
    counts.quiet = quiet - touched
    return counts


def code_message(
    delta: DeltaProgram,
    shadow: Shadow,
    m: Message,
    parts: tuple[PartProgram, ...],
    sources: Mapping[str, torch.Tensor],
    buf: torch.Tensor,
    counts: DeltaCounts,
    tick: Callable[[str], None] = lambda phase: None,
) -> tuple[int, int]:
    """A sender's message ``m`` of a delta sync: compare it with its shadow, code what changed into ``buf``
    (the message's size; or pack it whole), update the shadow; the mode and payload bytes (the payload is
    ``buf[:nbytes]``). ``tick(phase)`` marks the end of "pack", "compare" and "code"."""
    itemsize = message_itemsize(parts)
    # on CPU, copies whose source holds the wire's bits are compared where they are, not packed
    runs = None if itemsize is None else message_runs(shadow.of(delta, m), buf, parts, sources)
    if runs is None:
        pack(buf, parts, sources)
    tick("pack")
    if itemsize is None:
        mode, nbytes = WHOLE, buf.numel()
    elif runs is None:
        mode, nbytes = _code_packed(delta, shadow, m, itemsize, buf, counts, tick)
    else:
        mode, nbytes = _code_runs(delta, shadow, m, parts, sources, itemsize, buf, runs, counts, tick)
    tick("code")
    return mode, nbytes


def _code_runs(
    delta: DeltaProgram,
    shadow: Shadow,
    m: Message,
    parts: tuple[PartProgram, ...],
    sources: Mapping[str, torch.Tensor],
    itemsize: int,
    buf: torch.Tensor,
    runs: list[Run],
    counts: DeltaCounts,
    tick: Callable[[str], None],
) -> tuple[int, int]:
    """On CPU: compare the runs (``message_runs``), code what changed into ``buf`` (or pack it whole),
    update the shadow; the mode and payload bytes."""
    old = shadow.of(delta, m)
    elements = m.nbytes // itemsize
    counts.compared += elements
    limit = elements // MAX_CHANGED_SHARE
    changed, changes = find_changes(runs, itemsize, limit, delta.scratch, update=True)  # the shadow too
    counts.changed += changed
    tick("compare")
    if changes is None or max_encoded_bytes(changed, itemsize) > buf.numel():
        pack(buf, parts, sources)
        old.copy_(buf)
        return WHOLE, buf.numel()
    if changed == 0:
        return NONE, 0
    return CODED, encode_changes(changes, itemsize, buf.numpy(), delta.scratch)


def _code_packed(
    delta: DeltaProgram,
    shadow: Shadow,
    m: Message,
    itemsize: int,
    buf: torch.Tensor,
    counts: DeltaCounts,
    tick: Callable[[str], None],
) -> tuple[int, int]:
    """The same off CPU, in torch: the packed message against the shadow."""
    bits = bits_dtype(itemsize)
    new = buf.view(bits)
    old = shadow.of(delta, m).view(bits)
    counts.compared += new.numel()
    changed, positions = changed_positions(new, old, new.numel() // MAX_CHANGED_SHARE)
    counts.changed += changed
    tick("compare")
    if positions is None or max_encoded_bytes(changed, itemsize) > buf.numel():
        old.copy_(new)
        return WHOLE, buf.numel()
    if changed == 0:
        return NONE, 0
    values = new.index_select(0, positions)
    nbytes = encode(new, old, positions, buf, values)
    old.index_copy_(0, positions, values)
    return CODED, nbytes


def check_head(m: Message, mode: int, nbytes: int, rank: int) -> None:
    """A receiver's check of a delta head for message ``m`` (mode and payload bytes) before it reads on."""
    if mode == NONE and nbytes == 0:
        return
    if mode not in (CODED, WHOLE) or not 0 < nbytes <= m.nbytes or (mode == WHOLE and nbytes != m.nbytes):
        raise WireFormatError(
            f"rank {rank}: rank {m.peer} sent a delta head (mode {mode}, {nbytes} bytes) that does not fit "
            f"message {m.round} ({m.nbytes} bytes)"
        )


def apply_message(
    delta: DeltaProgram,
    m: Message,
    parts: tuple[PartProgram, ...],
    mode: int,
    payload: torch.Tensor,
    targets: Targets,
    touched: set[str],
    rank: int,
) -> None:
    """A receiver's message ``m`` of a delta sync, its head checked (``check_head``): unpack it whole, or
    write its coded changes (adding the targets they land in to ``touched``)."""
    if mode == WHOLE:
        unpack(payload, parts, targets)
        return
    itemsize = message_itemsize(parts)
    if itemsize is None:
        raise WireFormatError(f"rank {rank}: rank {m.peer} coded a message of mixed dtypes")
    try:
        landing = delta.landing(m, parts, itemsize)
        apply_changes(payload, landing, targets, m.nbytes // itemsize, delta.scratch, touched)
    except ValueError as e:
        raise WireFormatError(f"rank {rank}: message {m.round} from rank {m.peer}: {e}") from e
    for p in parts:
        targets.landed(p.name)
