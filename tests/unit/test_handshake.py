"""The ZeroMQ handshake, with the coordinator in this thread and peers in threads (real sockets on loopback)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from rollout_sync.errors import HandshakeError, SyncTimeoutError
from rollout_sync.handshake import ROLLOUT, TRAINER, Coordinator, Peer
from rollout_sync.handshake.messages import PROTOCOL

TOKEN = "s3cret"


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def peer_job(
    address: str,
    role: str,
    group: int,
    rank: int,
    size: int,
    token: str = TOKEN,
    ready: bool = True,
    fields: dict[str, Any] | None = None,
    timeout: float = 10,
):
    def job() -> Any:
        peer = Peer(address, token=token, timeout=timeout)
        try:
            welcome = peer.hello(
                role=role,
                group=group,
                local_rank=rank,
                local_size=size,
                fields=fields,
                payload=f"maps of {role}{rank}".encode(),
            )
            if ready:
                peer.ready()
            return welcome
        finally:
            peer.close()

    return job


def test_every_peer_is_admitted_ranked_trainers_first_and_welcomed_with_its_own_payload():
    coord = Coordinator(token=TOKEN, trainer_world=2, engines=2, timeout=10)
    jobs = [
        in_thread(peer_job(coord.address, ROLLOUT, 1, 0, 1)),
        in_thread(peer_job(coord.address, ROLLOUT, 0, 1, 2)),
        in_thread(peer_job(coord.address, TRAINER, 0, 1, 2)),
        in_thread(peer_job(coord.address, ROLLOUT, 0, 0, 2)),
        in_thread(peer_job(coord.address, TRAINER, 0, 0, 2)),
    ]
    try:
        peers = coord.admit()
        ranks = {p.name: coord.global_rank(p) for p in peers}
        assert ranks == {
            "trainer rank 0": 0,
            "trainer rank 1": 1,
            "engine 0 worker 0": 2,
            "engine 0 worker 1": 3,
            "engine 1 worker 0": 4,
        }
        assert coord.world_size == 5
        assert {p.payload for p in peers} == {
            b"maps of trainer0",
            b"maps of trainer1",
            b"maps of rollout0",
            b"maps of rollout1",
        }
        coord.welcome(
            {p.identity: ({"rank": coord.global_rank(p)}, b"half %d" % coord.global_rank(p)) for p in peers}
        )
    finally:
        coord.close()
    for t, out in jobs:
        t.join(10)
        assert "error" not in out, out.get("error")
    got = sorted((out["value"].fields["rank"], out["value"].payload) for _, out in jobs)
    assert got == [(r, b"half %d" % r) for r in range(5)]


def test_a_wrong_token_is_refused_with_a_clear_error_on_both_sides_and_the_others_are_aborted():
    coord = Coordinator(token=TOKEN, trainer_world=2, engines=0, timeout=10)
    good_t, good = in_thread(peer_job(coord.address, TRAINER, 0, 0, 2))
    time.sleep(0.3)
    bad_t, bad = in_thread(peer_job(coord.address, TRAINER, 0, 1, 2, token="guess"))
    try:
        with pytest.raises(HandshakeError, match="wrong token"):
            coord.admit()
    finally:
        coord.close()
    bad_t.join(10)
    good_t.join(10)
    assert isinstance(bad["error"], HandshakeError) and "wrong token" in str(bad["error"])
    assert isinstance(good["error"], HandshakeError) and "aborted" in str(good["error"])


def test_a_peer_speaking_another_message_version_is_refused_naming_both_versions():
    coord = Coordinator(token=TOKEN, trainer_world=1, engines=0, timeout=10)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(coord.address)
    header = {
        "proto": PROTOCOL,
        "version": 2,
        "kind": "hello",
        "token": TOKEN,
        "role": TRAINER,
        "group": 0,
        "local_rank": 0,
        "local_size": 1,
    }
    sock.send_multipart([json.dumps(header).encode(), b""])
    try:
        with pytest.raises(HandshakeError, match="message version 2, this side speaks 1"):
            coord.admit()
        assert sock.poll(5000)
        reply = json.loads(sock.recv_multipart()[0])
        assert reply["kind"] == "refused" and "version 2" in reply["reason"]
    finally:
        sock.close(0)
        coord.close()


def test_a_peer_refuses_a_coordinator_that_answers_in_another_version():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    t, out = in_thread(peer_job(f"tcp://127.0.0.1:{port}", TRAINER, 0, 0, 1))
    try:
        assert router.poll(5000)
        identity, *_ = router.recv_multipart()
        router.send_multipart(
            [
                identity,
                json.dumps({"proto": PROTOCOL, "version": 7, "kind": "welcome", "token": TOKEN}).encode(),
                b"",
            ]
        )
        t.join(10)
    finally:
        router.close(0)
    assert isinstance(out["error"], HandshakeError)
    assert "version 7" in str(out["error"])


def test_a_missing_peer_times_out_naming_it_and_the_waiting_peers_are_aborted():
    coord = Coordinator(token=TOKEN, trainer_world=2, engines=1, timeout=1.5)
    t, out = in_thread(peer_job(coord.address, TRAINER, 0, 0, 2))
    start = time.monotonic()
    try:
        with pytest.raises(SyncTimeoutError, match=r"trainer rank 1, engine 0 \(no worker yet\)"):
            coord.admit()
    finally:
        coord.close()
    assert time.monotonic() - start < 5
    t.join(10)
    # the waiting peer fails as the coordinator does: a timeout, which a job may answer by joining again
    assert isinstance(out["error"], SyncTimeoutError) and "timed out" in str(out["error"]), out["error"]


def test_a_peer_without_a_coordinator_times_out():
    start = time.monotonic()
    peer = Peer("tcp://127.0.0.1:9", token=TOKEN, timeout=0.5)
    try:
        with pytest.raises(SyncTimeoutError, match="no answer from the coordinator"):
            peer.hello(role=TRAINER, group=0, local_rank=0, local_size=1)
    finally:
        peer.close()
    assert time.monotonic() - start < 3


def test_a_duplicate_trainer_rank_is_refused():
    coord = Coordinator(token=TOKEN, trainer_world=2, engines=0, timeout=10)
    a_t, first = in_thread(peer_job(coord.address, TRAINER, 0, 0, 2))
    time.sleep(0.3)
    b_t, b = in_thread(peer_job(coord.address, TRAINER, 0, 0, 2))
    try:
        with pytest.raises(HandshakeError, match="trainer rank 0: joined twice"):
            coord.admit()
    finally:
        coord.close()
    a_t.join(10)
    b_t.join(10)
    assert isinstance(b["error"], HandshakeError) and "joined twice" in str(b["error"])
    assert isinstance(first["error"], HandshakeError) and "aborted" in str(first["error"])


def test_an_empty_token_is_refused_before_anything_is_sent():
    with pytest.raises(HandshakeError, match="non-empty shared token"):
        Coordinator(token="", trainer_world=1, engines=0)
    with pytest.raises(HandshakeError, match="non-empty shared token"):
        Peer("tcp://127.0.0.1:9", token="")


def hello_from(address: str, rank: int, pid: int, wait: bool) -> Callable[[], Any]:
    """Trainer rank ``rank`` of a 2-rank trainer, from process ``pid`` of machine ``m``; ``wait``: wait for
    the welcome and say ready, else leave the hello behind (a wait that ran out)."""
    fields = {"machine": "m", "pid": pid}
    return peer_job(address, TRAINER, 0, rank, 2, fields=fields, timeout=10 if wait else 0.3)


def test_a_process_that_says_hello_again_replaces_its_first_hello_and_another_process_is_refused():
    coord = Coordinator(token=TOKEN, trainer_world=2, engines=0, timeout=10)
    try:
        first_t, first = in_thread(hello_from(coord.address, 0, pid=7, wait=False))
        first_t.join(10)  # its hello reached the coordinator; its wait for the welcome ran out
        assert isinstance(first["error"], SyncTimeoutError), first
        # rank 0's second hello first: were rank 1's first, admit could complete with rank 0's stale hello
        # (its socket gone: the welcome would be unroutable), as it did once on a loaded machine
        jobs = [in_thread(hello_from(coord.address, 0, pid=7, wait=True))]
        time.sleep(1.0)
        jobs.append(in_thread(hello_from(coord.address, 1, pid=8, wait=True)))
        peers = coord.admit()
        assert [(p.local_rank, p.fields["pid"]) for p in peers] == [(0, 7), (1, 8)]
        coord.welcome({p.identity: ({"rank": p.local_rank}, b"") for p in peers})
        for t, out in jobs:
            t.join(10)
            assert "value" in out, out
    finally:
        coord.close()
    coord = Coordinator(token=TOKEN, trainer_world=2, engines=0, timeout=10)
    try:
        a_t, _ = in_thread(hello_from(coord.address, 0, pid=7, wait=True))
        time.sleep(0.3)
        b_t, b = in_thread(hello_from(coord.address, 0, pid=9, wait=True))
        with pytest.raises(HandshakeError, match="trainer rank 0: joined twice"):
            coord.admit()
    finally:
        coord.close()
    a_t.join(10)
    b_t.join(10)
    assert isinstance(b["error"], HandshakeError) and "joined twice" in str(b["error"])


def test_a_hello_nobody_answered_is_dropped_with_its_socket():
    """A peer whose coordinator was not there yet times out and closes; a coordinator bound afterwards on that
    address never receives the old hello, so the peer's next try is its only hello."""
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    early = Peer(f"tcp://127.0.0.1:{port}", token=TOKEN, timeout=0.3)
    with pytest.raises(SyncTimeoutError):
        early.hello(role=TRAINER, group=0, local_rank=0, local_size=2)
    early.close()
    coord = Coordinator(token=TOKEN, trainer_world=2, engines=0, timeout=10, port=port)
    time.sleep(0.5)  # longer than zmq's reconnect interval: a socket still lingering would deliver by now
    try:
        jobs = [in_thread(peer_job(coord.address, TRAINER, 0, r, 2)) for r in (0, 1)]
        peers = coord.admit()  # with the old hello delivered, rank 0 would be refused here: joined twice
        coord.welcome({p.identity: ({}, b"") for p in peers})
        for t, out in jobs:
            t.join(10)
            assert "value" in out, out
    finally:
        coord.close()


def test_a_closed_coordinator_s_address_can_be_bound_again_at_once():
    """A handshake joined again in the same process (after a failed sync) binds the same port: ``close``
    returns only once the port is free. With a shared context the close was asynchronous and the next bind
    failed with 'Address already in use' in most tries (reproduced 147 times in 200)."""
    first = Coordinator(token=TOKEN, trainer_world=1, engines=0, host="127.0.0.1")
    port = first.port
    first.close()
    for _ in range(30):
        coord = Coordinator(token=TOKEN, trainer_world=1, engines=0, host="127.0.0.1", port=port)
        client = zmq.Context.instance().socket(zmq.DEALER)
        client.connect(coord.address)
        client.send(b"hello?")
        assert coord.next_message(5.0) is None  # malformed: answered REFUSED and skipped
        assert client.poll(5000), "the refusal did not arrive"
        client.recv_multipart()
        client.close(linger=0)
        coord.close()
        coord.close()  # a second close does nothing
