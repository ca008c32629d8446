"""Handshake messages on the wire: versioned, typed, never pickled.

A message is two ZeroMQ frames: a UTF-8 JSON header and an opaque payload (maps or a plan half, in the
format of ``rollout_sync.planning.wire``). The header always carries ``proto``, ``version``, ``kind`` and the
sender's ``token``; the remaining keys depend on the kind. A peer that speaks another protocol or version
is refused with a message that names both versions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import WireFormatError

PROTOCOL = "rollout-sync-handshake"
VERSION = 1

HELLO = "hello"  # peer -> coordinator: who I am, my maps (payload)
WELCOME = "welcome"  # coordinator -> peer: global rank, group address, plan digest, my half (payload)
READY = "ready"  # peer -> coordinator: I joined the sync group
REFUSED = "refused"  # coordinator -> peer: you are not admitted (reason)
ABORT = "abort"  # coordinator -> peer: the handshake failed elsewhere (reason)
KINDS = frozenset({HELLO, WELCOME, READY, REFUSED, ABORT})

MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class Message:
    kind: str
    token: str
    fields: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""


def encode(message: Message) -> list[bytes]:
    if message.kind not in KINDS:
        raise WireFormatError(f"unknown handshake message kind {message.kind!r}")
    header = {"proto": PROTOCOL, "version": VERSION, "kind": message.kind, "token": message.token}
    clash = set(header) & set(message.fields)
    if clash:
        raise WireFormatError(f"message fields {sorted(clash)} collide with the header")
    header.update(message.fields)
    return [json.dumps(header, sort_keys=True, separators=(",", ":")).encode(), message.payload]


def decode(frames: list[bytes]) -> Message:
    """Parse two frames into a Message; raise WireFormatError naming what is wrong."""
    if len(frames) != 2:
        raise WireFormatError(f"a handshake message has 2 frames, found {len(frames)}")
    raw, payload = frames
    if len(raw) > MAX_HEADER_BYTES:
        raise WireFormatError(f"handshake header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"handshake header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireFormatError("handshake header is not a JSON object")
    if header.get("proto") != PROTOCOL:
        raise WireFormatError(f"peer speaks protocol {header.get('proto')!r}, expected {PROTOCOL!r}")
    if header.get("version") != VERSION:
        raise WireFormatError(
            f"peer speaks handshake message version {header.get('version')!r}, this side speaks {VERSION}"
        )
    kind = header.pop("kind", None)
    if kind not in KINDS:
        raise WireFormatError(f"unknown handshake message kind {kind!r}")
    token = header.pop("token", None)
    if not isinstance(token, str):
        raise WireFormatError("handshake message carries no token")
    del header["proto"], header["version"]
    return Message(kind=kind, token=token, fields=header, payload=bytes(payload))
