"""Delta sync: each sender sends only the elements that changed since the last sync it committed.

**What a sender compares.** A delta sync runs the rank's half as a schedule in which every segment is packed
(no direct messages, no shared slots, one element size per message: ``DeltaProgram``), with the message
sizes the agreement gave. The
sender compares each message as a full sync would pack it (cast to the wire dtype, so a change is a change of
what the receiver holds), bit for bit, with the same message as it last sent it: its **shadow**, one byte
buffer per rank holding every message it sends, laid end to end (``DeltaProgram.shadow_at``,
``delta.shadow.Shadow``). On CPU a copy whose source storage already holds the wire's bit patterns is
compared where it is (``delta.shadow.message_runs``, ``delta.compare``), and only a message sent whole is
packed. The shadow costs the bytes this rank sends per sync (``shadow_bytes``), once, on the sender only; it
is kept only where ``ExecuteOptions.delta`` is on. Coding and applying reuse ``DeltaProgram.scratch``
(``delta.compare.Scratch``: a few bytes per element a message may change, kept while the layout stays).

**What travels.** Per message, a 16-byte head (int64 mode and payload bytes) and, unless nothing changed, a
payload: the changes coded by ``delta.change_codec`` when at most ``1/MAX_CHANGED_SHARE`` of its elements changed
(the positions then cost less than the values they spare), else the whole message as a full sync would send
it. The head of round ``k`` has tag
``2k + 1``, the payload ``2k``. Segments between ranks of one process (handoffs) and within a rank are
copied whole, as in a full sync: they are memory copies.

**What a receiver does.** For a coded message it finds where each changed element lands (``Landing``: the
message's copies as tables; on CPU, for 1-D copies, a binary search per copy and an affine map per element,
else a binary search and an unravel per element: ``delta.landing``), reads the old values there (the receiver holds the base version: the agreement checked it), decodes the new ones and
writes them. A whole message is unpacked as in a full sync.

**When.** Every rank puts its base in the agreement record: the version of the last sync it committed under
the same plan and message sizes, with its storages untouched since (a receiver whose targets are streamed
cannot: a layer's loaded form does not outlive its sync). A delta sync runs only when every rank names the
same base under the layout agreed now (``agreement.delta_base``); anything else (a first sync, a failed or
refused one, a new executor after a re-handshake, a restarted engine, another plan) is a full sync, which
refills the shadow. Each rank forgets its base when a sync starts and gets it back only from ``committed``.

**Falling back.** A sender also keeps a sample of what it sent (every ``delta.shadow.SAMPLE_STRIDE``-th
element of each source storage, in the wire dtype). Before the agreement it compares the sample with its
sources; when more than ``FALLBACK_SHARE`` changed it names no base, so the sync is full, and it does not
refill its shadow (the next sync is then full too, and refills it if its sample says that one is worth a
delta).

Where it lives: this module holds the thresholds, the layout key and the ``DeltaProgram``; ``delta.shadow``
the sender's shadow and sample; ``delta.landing`` where a coded message's changes land; ``delta.run`` the
messages of one delta sync (heads, payloads, round by round); ``delta.state`` what an executor keeps between
syncs (the base it names, the shadow's validity) and when it runs a delta; ``delta.change_codec`` the coding.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..core.pair_messages import Message
from ..core.program import PartProgram, Program
from .compare import Scratch
from .landing import Landing

__all__ = [
    "FALLBACK_SHARE",
    "MAX_CHANGED_SHARE",
    "DeltaProgram",
    "layout_key",
    "message_itemsize",
]

MAX_CHANGED_SHARE = 32
"""A message is coded when at most 1/32 of its elements changed, else sent whole. Bytes alone would code up
to about 85% changed (2.3 bytes per changed bf16 element against 2 per element), but on this 2-core CPU
finding the changes costs about 1 ns per element compared (changed or not), coding them about 5 ns per
changed element and applying them 30-90 ns (reads and writes scattered over the targets), against about
1.5 ns per element for a whole message over loopback gloo: past a few percent a whole message is faster
here."""

FALLBACK_SHARE = 1 / MAX_CHANGED_SHARE
"""The default of ``ExecuteOptions.delta_full_above``: a sender whose sample says more than this share of
what it sends changed asks for a full sync. Nearly every message would travel whole, and a full sync moves
those bytes with fewer copies (direct messages, no shadow to compare or update)."""


def layout_key(digest: str, offers: list[int], depth: int) -> bytes:
    """What fixes every message of every rank: the plan, the agreed message offers and the depth. The same
    on every rank after the agreement."""
    text = f"{digest}|{depth}|{','.join(str(o) for o in offers)}"
    return hashlib.sha256(text.encode()).digest()[:8]


def message_itemsize(parts: tuple[PartProgram, ...]) -> int | None:
    """The element size shared by every part of a message (its parts then tile it with no gap), else None."""
    sizes = {p.wire_size for p in parts}
    return sizes.pop() if len(sizes) == 1 else None


@dataclass
class DeltaProgram:
    """The all-packed program a delta sync runs, the sender's shadow layout, the receiver's landings."""

    program: Program
    layout: bytes
    shadow_at: dict[tuple[int, int], int]  # (peer, round) of a send message -> its byte offset in the shadow
    shadow_bytes: int
    landings: dict[tuple[int, int], Landing] = field(default_factory=dict)
    scratch: Scratch = field(default_factory=Scratch)  # what coding and applying reuse, message to message

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
