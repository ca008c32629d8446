"""The coordinator's side of the handshake (runs on trainer rank 0).

State machine, coordinator side::

    LISTENING ──hello (valid)──────────────► LISTENING, until every expected peer is in ──► ADMITTED
    LISTENING ──hello (bad token, other version, duplicate or unexpected peer)──► reply REFUSED to it,
              ABORT to the admitted peers, raise HandshakeError
    LISTENING ──deadline──► ABORT to the admitted peers, raise SyncTimeoutError naming the missing peers
    ADMITTED  ──welcome(replies)──► WELCOMED ──ready from every peer──► DONE
    WELCOMED  ──deadline──► ABORT, raise SyncTimeoutError naming the peers not ready
    any state ──abort(reason)──► ABORT to every admitted peer

Expected peers: trainer ranks ``0..trainer_world-1`` and, for each of ``engines`` rollout engines, its
workers ``0..size-1`` (an engine's size is read from its workers' hellos, which must agree). Global ranks:
trainer rank r is global rank r; engine e's worker w is ``trainer_world + (sizes of engines before e) + w``.
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from ..errors import HandshakeError, SyncTimeoutError, WireFormatError
from ..transport.core.network import is_loopback
from .messages import ABORT, HELLO, READY, REFUSED, WELCOME, Message, decode, encode

TRAINER = "trainer"
ROLLOUT = "rollout"


@dataclass(frozen=True)
class PeerInfo:
    """One admitted peer, as its hello described it."""

    identity: bytes
    role: str  # TRAINER or ROLLOUT
    group: int  # 0 for trainer ranks; the engine index for rollout workers
    local_rank: int  # the trainer rank, or the worker's TP rank in its engine
    local_size: int  # the trainer world size, or the engine's number of workers
    fields: Mapping[str, Any]
    payload: bytes

    @property
    def name(self) -> str:
        return (
            f"trainer rank {self.local_rank}"
            if self.role == TRAINER
            else (f"engine {self.group} worker {self.local_rank}")
        )


def _retried_by(earlier: PeerInfo, later: PeerInfo) -> bool:
    """``later`` is ``earlier``'s own process joining again (a new socket after its wait for a welcome ran
    out): same place in the roster, same machine and pid. Another process in the same place joined twice."""
    same_place = (earlier.role, earlier.group, earlier.local_rank) == (
        later.role,
        later.group,
        later.local_rank,
    )
    process = [(p.fields.get("machine"), p.fields.get("pid")) for p in (earlier, later)]
    return (
        same_place
        and earlier.identity != later.identity
        and process[0] == process[1]
        and None not in process[0]
    )


class Coordinator:
    def __init__(
        self,
        *,
        token: str,
        trainer_world: int,
        engines: int,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 120.0,
    ) -> None:
        if not token:
            raise HandshakeError("a non-empty shared token is required (argument or ROLLOUT_SYNC_TOKEN)")
        if trainer_world < 1 or engines < 0:
            raise ValueError(
                f"expected trainer_world >= 1 and engines >= 0, found {trainer_world}, {engines}"
            )
        self._token = token
        self.trainer_world = trainer_world
        self.engines = engines
        self.timeout = timeout
        # A context of its own: closing it (``close``) returns only once the port is released, so a
        # handshake joined again in the same process can bind the same address at once.
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        self.host = host
        self.port = port
        self.peers: dict[bytes, PeerInfo] = {}

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    # -- LISTENING -> ADMITTED ---------------------------------------------------------------------------
    def admit(self) -> list[PeerInfo]:
        """Wait for every expected peer's hello; return them in global-rank order."""
        deadline = time.monotonic() + self.timeout
        while not self._complete():
            identity, message = self._receive(deadline, waiting_for=self._missing)
            if message.kind != HELLO:
                self._refuse(identity, f"expected a hello, received {message.kind!r}")
            self._admit_one(identity, message)
        return sorted(self.peers.values(), key=lambda p: self.global_rank(p))

    def _admit_one(self, identity: bytes, message: Message) -> None:
        f = message.fields
        try:
            role = str(f["role"])
            group, local_rank, local_size = int(f["group"]), int(f["local_rank"]), int(f["local_size"])
        except (KeyError, TypeError, ValueError):
            self._refuse(identity, f"hello lacks role/group/local_rank/local_size: {sorted(f)}")
        info = PeerInfo(identity, role, group, local_rank, local_size, dict(f), message.payload)
        for earlier in [q for q in self.peers.values() if _retried_by(q, info)]:
            del self.peers[earlier.identity]  # the same process saying hello again: its first wait ended
        problem = self._unexpected(info)
        if problem:
            self._refuse(identity, f"{info.name}: {problem}")
        self.peers[identity] = info

    def _unexpected(self, p: PeerInfo) -> str | None:
        if p.role == TRAINER:
            if p.local_size != self.trainer_world:
                return f"trainer world size {p.local_size}, expected {self.trainer_world}"
            if not 0 <= p.local_rank < self.trainer_world or p.group != 0:
                return f"trainer rank {p.local_rank} outside 0..{self.trainer_world - 1}"
        elif p.role == ROLLOUT:
            if not 0 <= p.group < self.engines:
                return f"engine index {p.group} outside 0..{self.engines - 1}"
            sizes = {q.local_size for q in self.peers.values() if q.role == ROLLOUT and q.group == p.group}
            if sizes and p.local_size not in sizes:
                return f"engine size {p.local_size}, its other workers said {sizes.pop()}"
            if not 0 <= p.local_rank < p.local_size:
                return f"worker rank {p.local_rank} outside 0..{p.local_size - 1}"
        else:
            return f"unknown role {p.role!r}"
        if any(
            (q.role, q.group, q.local_rank) == (p.role, p.group, p.local_rank) for q in self.peers.values()
        ):
            return "joined twice"
        return None

    def _engine_sizes(self) -> dict[int, int]:
        return {p.group: p.local_size for p in self.peers.values() if p.role == ROLLOUT}

    def _missing(self) -> list[str]:
        have = {(p.role, p.group, p.local_rank) for p in self.peers.values()}
        missing = [f"trainer rank {r}" for r in range(self.trainer_world) if (TRAINER, 0, r) not in have]
        sizes = self._engine_sizes()
        for e in range(self.engines):
            if e not in sizes:
                missing.append(f"engine {e} (no worker yet)")
                continue
            missing += [f"engine {e} worker {w}" for w in range(sizes[e]) if (ROLLOUT, e, w) not in have]
        return missing

    def _complete(self) -> bool:
        return not self._missing()

    def global_rank(self, peer: PeerInfo) -> int:
        if peer.role == TRAINER:
            return peer.local_rank
        sizes = self._engine_sizes()
        return self.trainer_world + sum(sizes[e] for e in range(peer.group)) + peer.local_rank

    @property
    def world_size(self) -> int:
        return self.trainer_world + sum(self._engine_sizes().values())

    # -- ADMITTED -> WELCOMED -> DONE ----------------------------------------------------------------------
    def welcome(self, replies: Mapping[bytes, tuple[dict[str, Any], bytes]]) -> None:
        """Send each admitted peer its welcome (fields and payload), then wait until every peer is ready."""
        for identity in self.peers:
            fields, payload = replies[identity]
            self._send(identity, Message(WELCOME, self._token, dict(fields), payload))
        deadline = time.monotonic() + self.timeout
        ready: set[bytes] = set()

        def not_ready() -> list[str]:
            return [p.name for i, p in self.peers.items() if i not in ready]

        while len(ready) < len(self.peers):
            identity, message = self._receive(deadline, waiting_for=not_ready)
            if identity not in self.peers:
                self._refuse(identity, "the handshake is closed: every expected peer was already admitted")
            if message.kind == ABORT:
                reason = message.fields.get("reason", "")
                self.abort(f"{self.peers[identity].name} failed: {reason}")
                raise HandshakeError(f"{self.peers[identity].name} failed to join the sync group: {reason}")
            if message.kind != READY:
                self._refuse(identity, f"expected ready, received {message.kind!r}")
            ready.add(identity)

    def abort(self, reason: str, *, timed_out: bool = False) -> None:
        """Tell every admitted peer that the handshake failed (best effort, never blocks); ``timed_out``:
        because a wait ran out (each peer then raises ``SyncTimeoutError``, as the coordinator does)."""
        fields = {"reason": reason, **({"timed_out": True} if timed_out else {})}
        for identity in self.peers:
            with contextlib.suppress(zmq.ZMQError):
                self._send(identity, Message(ABORT, self._token, fields), block=False)

    def close(self) -> None:
        """Close the socket (unsent messages get 200 ms) and release its address before returning."""
        if self._ctx.closed:
            return
        self._sock.close(linger=200)
        self._ctx.term()

    # -- after the handshake: an admission desk (``sync.admission``) keeps the socket ------------------------
    def next_message(self, wait_s: float) -> tuple[bytes, Message] | None:
        """The next valid message within ``wait_s`` seconds, or None. One with a bad token or another
        message version is answered REFUSED and skipped: nobody else is told."""
        if not self._sock.poll(max(int(wait_s * 1000), 0)):
            return None
        identity, *frames = self._sock.recv_multipart()
        try:
            message = decode(frames)
        except WireFormatError as exc:
            self.refuse_one(identity, str(exc))
            return None
        if not hmac.compare_digest(message.token.encode(), self._token.encode()):
            self.refuse_one(identity, "wrong token: the peer's token does not match the coordinator's")
            return None
        return identity, message

    def refuse_one(self, identity: bytes, reason: str) -> None:
        """Reply REFUSED to one peer (best effort)."""
        with contextlib.suppress(zmq.ZMQError):
            self._send(identity, Message(REFUSED, "", {"reason": reason}), block=False)

    def welcome_one(self, identity: bytes, fields: Mapping[str, Any], payload: bytes) -> None:
        self._send(identity, Message(WELCOME, self._token, dict(fields), payload), block=False)

    # -- plumbing -------------------------------------------------------------------------------------------
    def _receive(self, deadline: float, waiting_for: Any) -> tuple[bytes, Message]:
        """Next valid message; refuses (and raises on) a bad token or another version."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                missing = ", ".join(waiting_for())
                self.abort(
                    f"handshake timed out after {self.timeout:.0f} s waiting for {missing}", timed_out=True
                )
                raise SyncTimeoutError(
                    f"handshake timed out after {self.timeout:.0f} s waiting for {missing}{self._hint()}"
                )
            identity, *frames = self._sock.recv_multipart()
            try:
                message = decode(frames)
            except WireFormatError as exc:
                self._refuse(identity, str(exc))
            if not hmac.compare_digest(message.token.encode(), self._token.encode()):
                self._refuse(identity, "wrong token: the peer's token does not match the coordinator's")
            return identity, message

    def _hint(self) -> str:
        """Why peers on other hosts may not have arrived: the coordinator listens on loopback only."""
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        bound = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        host = bound.rsplit(":", 1)[0].removeprefix("tcp://")
        if not is_loopback(host):
            return ""
        return (
            f" (the coordinator listens on {bound}, a loopback address: {self.host!r} resolves to it here, so "
            "peers on other hosts cannot connect; name it by an address they reach)"
        )

    def _refuse(self, identity: bytes, reason: str) -> Any:
        """Reply REFUSED to the offender, ABORT to the admitted peers, and raise HandshakeError."""
        with contextlib.suppress(zmq.ZMQError):
            self._send(identity, Message(REFUSED, "", {"reason": reason}), block=False)
        self.abort(f"the handshake refused a peer: {reason}")
        raise HandshakeError(f"refused a peer: {reason}")

    def _send(self, identity: bytes, message: Message, block: bool = True) -> None:
        self._sock.send_multipart([identity, *encode(message)], flags=0 if block else zmq.NOBLOCK)


def tokens_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
