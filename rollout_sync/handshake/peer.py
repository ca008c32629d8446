"""A peer's side of the handshake (every trainer rank and every vLLM worker).

State machine, peer side::

    CONNECTED ──hello──► WAITING ──welcome──► WELCOMED ──ready()──► DONE
    WAITING   ──refused / abort──► raise HandshakeError with the coordinator's reason (SyncTimeoutError
                                    when the coordinator gave up waiting for another peer)
    WAITING   ──deadline──► raise SyncTimeoutError
    WELCOMED  ──failed(reason)──► the coordinator aborts everyone
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from ..errors import HandshakeError, SyncTimeoutError, WireFormatError
from .messages import ABORT, HELLO, READY, REFUSED, WELCOME, Message, decode, encode


class Peer:
    def __init__(self, address: str, *, token: str, timeout: float = 120.0) -> None:
        if not token:
            raise HandshakeError("a non-empty shared token is required (argument or ROLLOUT_SYNC_TOKEN)")
        self.address = address
        self.timeout = timeout
        self._token = token
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)
        self._answered = False  # the coordinator answered the hello

    def hello(
        self,
        *,
        role: str,
        group: int,
        local_rank: int,
        local_size: int,
        fields: dict[str, Any] | None = None,
        payload: bytes = b"",
    ) -> Message:
        """Introduce this peer and wait for the coordinator's welcome."""
        body = {"role": role, "group": group, "local_rank": local_rank, "local_size": local_size}
        body.update(fields or {})
        self._sock.send_multipart(encode(Message(HELLO, self._token, body, payload)))
        return self._expect(WELCOME)

    def ready(self) -> None:
        self._sock.send_multipart(encode(Message(READY, self._token)))

    def failed(self, reason: str) -> None:
        """Tell the coordinator that this peer could not finish joining (it aborts everyone)."""
        self._sock.send_multipart(encode(Message(ABORT, self._token, {"reason": reason})))

    def close(self) -> None:
        """Close the socket: a ready or failure notice still queued gets 0.5 s to leave; a hello nobody
        answered is dropped, so that a join tried again cannot meet its own earlier hello."""
        self._sock.close(linger=500 if self._answered else 0)

    def _expect(self, kind: str) -> Message:
        deadline = time.monotonic() + self.timeout
        left = deadline - time.monotonic()
        if not self._sock.poll(int(max(left, 0) * 1000)):
            raise SyncTimeoutError(
                f"no answer from the coordinator at {self.address} within {self.timeout:.0f} s"
            )
        frames = self._sock.recv_multipart()
        self._answered = True
        try:
            message = decode(frames)
        except WireFormatError as exc:
            raise HandshakeError(
                f"the coordinator at {self.address} answered in another format: {exc}"
            ) from None
        if message.kind in (REFUSED, ABORT):
            verb = "refused this peer" if message.kind == REFUSED else "aborted the handshake"
            error = SyncTimeoutError if message.fields.get("timed_out") else HandshakeError
            raise error(f"the coordinator at {self.address} {verb}: {message.fields.get('reason', '')}")
        if message.kind != kind:
            raise HandshakeError(f"expected {kind!r} from the coordinator, received {message.kind!r}")
        return message
