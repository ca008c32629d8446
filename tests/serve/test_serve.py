"""Real ``vllm serve`` servers on loopback (launched with ``python -m vllm_plugin.serve``), synced from a
2-rank ZeRO-3 DeepSpeed trainer through the servers' own HTTP routes (``/collective_rpc``, ``/pause``,
``/resume``, ``/update_weight_version``) and the ZeroMQ handshake, and through vLLM's weight-transfer routes
(``--weight-transfer-config '{"backend": "rollout_sync"}'``).

Two servers at TP 2 (engines 0 and 1, two workers each) are targets of one plan and one sync; afterwards
both equal a fresh TP-2 server loaded from the trainer's saved checkpoint (tokens over HTTP, every parameter
bit for bit). (Engines of different TP sizes in one plan are refused: their maps of one tensor are cut
differently, see the report of ``merge``.) Then the failures: a stale RPC
answer is refused; a trainer rank killed mid-sync makes every worker fail in time, each server keeps serving
without claiming the version, and a restarted trainer repairs it; a server killed mid-sync makes every
trainer rank raise in time naming that engine, a handshake refused for mismatching shapes (a trainer with a
larger vocabulary) names every mismatching tensor and leaves each server's next calls their own answers and a
second handshake and sync bit for bit, and a restarted server rejoins through a new handshake
without a trainer restart (same layout: the cached plan is reused). The trainer attaches with delta syncs:
the first sync after every handshake (a restarted trainer, a restarted server) is full, the next ones apply
on it, and both leave the servers bit for bit equal to the trainer. The servers are shared by the module
(start-up dominates: 40-140 s each here)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from rollout_sync.errors import PeerFailedError, ShapeMismatchError, SyncTimeoutError
from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankContext, RankError, RankPool, free_port
from testbed.trainer_ranks import attach, setup, train_step
from tests.e2e.e2e_steps import TRAINER_ENV, save_checkpoint
from tests.harness.vllm_engines import DEFAULT_PROMPTS
from tests.harness.whole_trainer import VOCAB_TENSORS, connect_whole_trainer
from tests.serve.servers import WEIGHT_TRANSFER, Server, launch, wait_all
from vllm_plugin.driver import apply_checkpoint, setup_engines
from vllm_plugin.http_driver import ServerEngine, check_answers

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]

TOKEN = "serve-token"
TRAINERS = 2
SYNC_TIMEOUT = 20.0  # the sync group's timeout: every failure below must surface within it (plus slack)
BOUND = 50.0  # no failure may take longer than this to surface


def reattach(ctx: RankContext, address: str, engines: int, timeout: float) -> int:
    """Drop the current sync (if any) and attach again through a new handshake (trainer not restarted), with
    delta syncs on: the failure tests below also show that every new handshake starts with a full sync."""
    old = ctx.state.pop("sync", None)
    if old is not None:
        old.detach()
    return attach(ctx, address, TOKEN, engines, 1, "balanced", timeout, delta=True)


def plan_reused(ctx: RankContext) -> bool | None:
    """Whether the last handshake reused a cached plan (trainer rank 0, which coordinates; None elsewhere)."""
    coordinated = ctx.state["sync"].coordinated
    return None if coordinated is None else bool(coordinated.reused_plan)


class Trainer:
    """A 2-rank ZeRO-3 trainer (AdamW, lr 1e-5) in a rank pool, restartable (fault tests kill it)."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.pool: RankPool | None = None
        self.step = 0

    def start(self) -> None:
        self.pool = RankPool(TRAINERS, env=TRAINER_ENV, timeout=600)
        # lr 1e-5: a step changes well under 1/32 of the bf16 weights, so delta syncs do not fall back to full
        self.pool.call(setup, DeepSpeedSpec("dense", 3, lr=1e-5), str(self.model))
        self.step = 0

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.close(kill=True)
            self.pool = None

    def live(self) -> RankPool:
        if self.pool is None:
            raise RuntimeError("the trainer is not running")
        return self.pool


def handshake(trainer: Trainer, engines: list[ServerEngine]) -> list[int]:
    """A new handshake: probe each server's workers, then trainer ranks and workers join a new group. A
    trainer-side failure is raised first: the servers' joins only wait for the coordinator it runs."""
    setup_engines(engines, first_rank=TRAINERS)
    address = f"tcp://127.0.0.1:{free_port()}"
    pending = trainer.live().submit(reattach, address, len(engines), SYNC_TIMEOUT)
    errors: list[BaseException] = []
    with ThreadPoolExecutor(len(engines)) as pool:
        joins = [pool.submit(e.connect, address, k, TOKEN, SYNC_TIMEOUT) for k, e in enumerate(engines)]
        for j in joins:
            try:
                j.result(SYNC_TIMEOUT * 3)
            except Exception as exc:
                errors.append(exc)
    ranks = pending.result(SYNC_TIMEOUT * 3)
    if errors:
        raise errors[0]
    return ranks


def step_and_receive(
    trainer: Trainer,
    engines: list[ServerEngine],
    on_start: Callable[[], None] | None = None,
    mode: str = "abort",
) -> tuple[Any, list[Future[list[dict[str, Any]]]]]:
    """One optimizer step (the hook syncs) while every server receives (``mode``: vLLM's pause mode for
    requests in flight); returns the trainer's pending result and each server's receive future (not yet
    waited for)."""
    trainer.step += 1
    pool = ThreadPoolExecutor(len(engines))
    receives = [pool.submit(e.receive, SYNC_TIMEOUT * 2, mode=mode) for e in engines]
    pending = trainer.live().submit(train_step, trainer.step)
    if on_start is not None:
        on_start()
    pool.shutdown(wait=False)
    return pending, receives


def digests(engine: ServerEngine) -> list[dict[str, str]]:
    return engine.call("param_digests")


def bases(trainer_side: list[dict[str, Any]], reports: list[list[dict[str, Any]]]) -> set[Any]:
    """The base versions every rank of one sync applied on (None: a full sync)."""
    return {t["sync"]["stats"]["delta_base"] for t in trainer_side} | {
        w["stats"]["delta_base"] for r in reports for w in r
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_sync.tiny import make_tiny_model

    return make_tiny_model("dense", tmp_path_factory.mktemp("serve_model") / "dense-seed0", 0)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve_logs")


@pytest.fixture(scope="module")
def servers(model: Path, logs: Path) -> Iterator[list[Server]]:
    # Two workers each; engine 0 also takes vLLM's weight-transfer routes (the last test).
    started = [
        launch(model, logs, "engine0", tp=2, extra=WEIGHT_TRANSFER),
        launch(model, logs, "engine1", tp=2),
    ]
    try:
        wait_all(started, timeout=400)
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def trainer(model: Path, servers: list[Server]) -> Iterator[Trainer]:
    t = Trainer(model)
    t.start()
    try:
        handshake(t, [s.engine for s in servers])
        yield t
    finally:
        t.stop()


def test_two_served_engines_at_tp_2_synced_in_one_step_equal_a_fresh_server_loaded_from_the_checkpoint(
    servers: list[Server], trainer: Trainer, model: Path, logs: Path, tmp_path: Path
) -> None:
    engines = [s.engine for s in servers]
    pending, receives = step_and_receive(trainer, engines)
    reports = [r.result(SYNC_TIMEOUT * 3) for r in receives]
    trainer_side = pending.result(SYNC_TIMEOUT * 3)
    version = trainer_side[0]["sync"]["version"]
    assert bases(trainer_side, reports) == {None}  # the first sync after a handshake is full
    assert [t["sync"]["version"] for t in trainer_side] == [version] * TRAINERS
    assert [[w["version"] for w in r] for r in reports] == [[version] * 2] * 2
    assert [e.weight_version() for e in engines] == [str(version)] * 2
    # Balanced policy: both trainer ranks send, and every worker (engine 0: ranks 2, 3; engine 1: ranks 4, 5)
    # receives.
    # as messages, or copied by a worker that maps the trainer rank's storages (same host)
    sent = [{**t["sync"]["stats"]["bytes_sent"], **t["sync"]["stats"]["bytes_mapped"]} for t in trainer_side]
    assert all(sent), sent
    assert sorted({peer for s in sent for peer in s}) == ["2", "3", "4", "5"], sent
    checkpoint = tmp_path / "step"
    trainer.live().call(save_checkpoint, str(checkpoint), str(model))
    fresh = launch(checkpoint, logs, "fresh-tp2", tp=2)
    try:
        wait_all([fresh], timeout=400)
        want_tokens = fresh.engine.complete_greedy(DEFAULT_PROMPTS, max_tokens=12)
        want_digests = digests(fresh.engine)
    finally:
        fresh.stop()
    for e in engines:
        assert e.complete_greedy(DEFAULT_PROMPTS, max_tokens=12) == want_tokens, e.name
        assert digests(e) == want_digests, e.name


def stream_greedy(
    engine: ServerEngine, prompt: list[int], max_tokens: int, started: threading.Event, got: list[int]
) -> list[int]:
    """A streamed greedy completion: every token id appended to ``got`` as its chunk arrives; ``started`` is
    set at the first token (the request is then running on the server)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    req = urllib.request.Request(
        engine.url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            got.extend(int(t) for t in chunk["choices"][0].get("token_ids") or [])
            if got:
                started.set()
    return got


TRIES = 20


def frozen_request(
    engine: ServerEngine, pool: ThreadPoolExecutor, tokens: int
) -> tuple[Future[list[int]], list[int]]:
    """A completion of ``tokens`` tokens frozen mid-way in a server paused in keep mode: started, then the
    server paused (``/pause?mode=keep``) once its first token arrived, and still unfinished once the chunks
    made before the pause have arrived. A request the server finished before the pause took effect (a fast
    decode, a client reading late, a pause answered late on a loaded machine: seen in CI) is let finish and
    another one tried, up to ``TRIES`` times."""
    for _ in range(TRIES):
        started, got = threading.Event(), []
        running = pool.submit(stream_greedy, engine, list(DEFAULT_PROMPTS[0]), tokens, started, got)
        assert started.wait(120), "the streamed completion produced no token"
        engine.request("/pause?mode=keep&clear_cache=false", {})
        seen, still = -1, time.monotonic()
        while time.monotonic() - still < 1.0 and not running.done():  # until no chunk came for 1 s
            if len(got) != seen:
                seen, still = len(got), time.monotonic()
            time.sleep(0.05)
        if not running.done() and len(got) < tokens:
            return running, got
        engine.request("/resume", {})
        running.result(120)
    raise AssertionError(f"{TRIES} completions of {tokens} tokens all finished before the server paused")


def test_a_sync_in_keep_mode_freezes_a_request_in_flight_which_then_completes(
    servers: list[Server], trainer: Trainer
) -> None:
    """``receive(mode="keep")`` passes vLLM's keep mode to ``/pause``: a completion frozen mid-way is not
    aborted (abort mode would end it), and returns every token it asked for once the servers resume on the
    new version. The request is frozen first (``frozen_request``: a sync started at a fixed head start, or at
    its first streamed token, let it finish before the pause on fast CI machines)."""
    engines = [s.engine for s in servers]
    pauses: list[str] = []
    request = engines[1].request

    def recorded_request(path: str, body: Any = None, timeout: float | None = None) -> Any:
        if path.startswith("/pause"):
            pauses.append(path)
        return request(path, body, timeout)

    with ThreadPoolExecutor(1) as pool:
        running, got = frozen_request(engines[1], pool, 240)
        frozen_at = len(got)
        with mock.patch.object(engines[1], "request", recorded_request):
            pending, receives = step_and_receive(trainer, engines, mode="keep")
            reports = [r.result(SYNC_TIMEOUT * 3) for r in receives]
        version = pending.result(SYNC_TIMEOUT * 3)[0]["sync"]["version"]
        streamed = running.result(120)
    assert [p.split("&")[0] for p in pauses] == ["/pause?mode=keep"], pauses
    assert 0 < frozen_at < 240, frozen_at  # in flight across the sync
    assert len(streamed) == 240  # frozen, then finished: no token lost
    assert [[w["version"] for w in r] for r in reports] == [[version] * 2] * 2
    assert [e.weight_version() for e in engines] == [str(version)] * 2


def test_a_stale_answer_from_an_earlier_call_is_refused() -> None:
    ok = [{"nonce": "a", "result": 1}, {"nonce": "a", "result": 2}]
    assert check_answers("e", "status", "a", ok) == [1, 2]
    stale = [{"nonce": "a", "result": 1}, {"nonce": "old", "error": "RuntimeError: previous call"}]
    with pytest.raises(PeerFailedError, match="engine e worker 1: status: stale"):
        check_answers("e", "status", "a", stale)
    with pytest.raises(PeerFailedError, match="stale"):
        check_answers("e", "status", "a", ["RuntimeError: previous call"])
    with pytest.raises(PeerFailedError, match="worker 0: status failed: boom"):
        check_answers("e", "status", "a", [{"nonce": "a", "error": "boom"}])


def test_after_a_failed_call_the_next_call_gets_its_own_answer(servers: list[Server]) -> None:
    engine = servers[0].engine
    with pytest.raises(PeerFailedError, match="engine engine0 worker 0: no_such_call failed"):
        engine.call("no_such_call")
    status = engine.call("status")
    assert status[0]["connected"] is True, status


def test_a_refused_handshake_names_every_mismatching_tensor_and_the_servers_next_calls_get_their_own_answers(
    servers: list[Server], trainer: Trainer, model: Path, tmp_path: Path
) -> None:
    engines = [s.engine for s in servers]
    before = [e.status() for e in engines]
    # A trainer whose model has 4 more vocabulary rows than the servers' (one rank, every tensor whole).
    address = f"tcp://127.0.0.1:{free_port()}"
    with ThreadPoolExecutor(1 + len(engines)) as pool:
        bad = pool.submit(
            connect_whole_trainer, model, address, engines=2, token=TOKEN, timeout=SYNC_TIMEOUT, grow=4
        )
        joins = [pool.submit(e.connect, address, k, TOKEN, SYNC_TIMEOUT) for k, e in enumerate(engines)]
        with pytest.raises(ShapeMismatchError) as refused:
            bad.result(SYNC_TIMEOUT * 3)
        for e, join in zip(engines, joins, strict=True):
            with pytest.raises(PeerFailedError) as failed:
                join.result(SYNC_TIMEOUT * 3)
            for worker in (0, 1):
                assert f"engine {e.name} worker {worker}: connect failed: HandshakeError" in str(failed.value)
            for text in (str(refused.value), str(failed.value)):
                for name in VOCAB_TENSORS:
                    assert f"'{name}': target (1000, 128), source (1004, 128)" in text, text
    # Each server's next call gets its own answer (the nonces are checked), its old link untouched.
    assert [e.status() for e in engines] == before
    # A second handshake with the right model on the same servers, then a sync: bit for bit.
    handshake(trainer, engines)
    pending, receives = step_and_receive(trainer, engines)
    reports = [r.result(SYNC_TIMEOUT * 3) for r in receives]
    version = pending.result(SYNC_TIMEOUT * 3)[0]["sync"]["version"]
    assert all(not w["incomplete"] and w["version"] == version for r in reports for w in r), reports
    checkpoint = tmp_path / "after_refusal"
    trainer.live().call(save_checkpoint, str(checkpoint), str(model))
    synced = [digests(e) for e in engines]
    apply_checkpoint(engines, str(checkpoint))
    assert [digests(e) for e in engines] == synced, "a server does not hold exactly the trainer's weights"


def test_a_trainer_rank_killed_mid_sync_fails_every_worker_in_time_and_a_restarted_trainer_repairs(
    servers: list[Server], trainer: Trainer, model: Path, tmp_path: Path
) -> None:
    engines = [s.engine for s in servers]
    before = [e.weight_version() for e in engines]
    before_status = [e.status()[0]["version"] for e in engines]
    start = time.monotonic()
    pending, receives = step_and_receive(trainer, engines, on_start=lambda: trainer.live().kill_rank(1))
    for e, r in zip(engines, receives, strict=True):
        with pytest.raises((PeerFailedError, SyncTimeoutError), match=e.name):
            r.result(BOUND)
    failed_in = time.monotonic() - start
    assert failed_in < BOUND, failed_in
    with pytest.raises(RankError):
        pending.result(BOUND)
    trainer.stop()
    for e, old, old_version in zip(engines, before, before_status, strict=True):
        status = e.status()[0]
        assert status["incomplete"] is True and status["version"] == old_version, status
        assert e.weight_version() == old, "a failed sync must not move the served weight version"
        assert len(e.complete_greedy(DEFAULT_PROMPTS[:1], max_tokens=4)[0]) == 4  # still serving

    trainer.start()  # the restart: new processes, new handshake
    handshake(trainer, engines)
    pending, receives = step_and_receive(trainer, engines)
    reports = [r.result(SYNC_TIMEOUT * 3) for r in receives]
    trainer_side = pending.result(SYNC_TIMEOUT * 3)
    version = trainer_side[0]["sync"]["version"]
    assert bases(trainer_side, reports) == {None}  # a new trainer, a new handshake: a full sync
    assert all(not w["incomplete"] and w["version"] == version for r in reports for w in r), reports
    assert [e.weight_version() for e in engines] == [str(version)] * 2
    checkpoint = tmp_path / "repaired"
    trainer.live().call(save_checkpoint, str(checkpoint), str(model))
    synced = [digests(e) for e in engines]
    apply_checkpoint(engines, str(checkpoint))  # a complete sync: writing the checkpoint changes no bit
    assert [digests(e) for e in engines] == synced
    print(f"\ntrainer rank killed: both servers failed after {failed_in:.1f} s")


def test_a_server_killed_mid_sync_makes_every_trainer_rank_raise_in_time_naming_it_and_the_other_serves(
    servers: list[Server], trainer: Trainer, model: Path, logs: Path
) -> None:
    engines = [s.engine for s in servers]
    before = engines[0].weight_version()
    start = time.monotonic()
    pending, receives = step_and_receive(trainer, engines, on_start=servers[1].kill)
    with pytest.raises(RankError) as raised:
        pending.result(BOUND)
    failed_in = time.monotonic() - start
    assert failed_in < BOUND, failed_in
    message = str(raised.value)
    print(f"\nserver killed: trainer raised after {failed_in:.1f} s: {message[:600]}")
    # Every trainer rank's error names the dead engine (index, global ranks, its workers' processes).
    blamed = "failed peer(s): engine 1 (global ranks 4, 5: worker 0 pid "
    assert message.count(blamed) >= TRAINERS, message
    assert "engine 0" not in message.split("failed peer(s):", 1)[1].split("]", 1)[0], message
    with pytest.raises((PeerFailedError, SyncTimeoutError)):
        receives[0].result(BOUND)
    with pytest.raises((PeerFailedError, SyncTimeoutError)):
        receives[1].result(BOUND)
    assert servers[0].engine.status()[0]["incomplete"] is True
    assert servers[0].engine.weight_version() == before, "a failed sync must not move the version"
    assert len(servers[0].engine.complete_greedy(DEFAULT_PROMPTS[:1], max_tokens=4)[0]) == 4


def test_a_restarted_server_rejoins_through_a_new_handshake_without_a_trainer_restart(
    servers: list[Server], trainer: Trainer, model: Path, logs: Path
) -> None:
    pids = [p.pid for p in trainer.live()._procs]
    servers[1].stop()
    servers[1] = launch(model, logs, "engine1-restarted", tp=2)
    wait_all([servers[1]], timeout=400)
    engines = [s.engine for s in servers]
    start = time.monotonic()
    handshake(trainer, engines)  # same trainer processes, new handshake and group
    rejoined_in = time.monotonic() - start
    assert [p.pid for p in trainer.live()._procs] == pids, "the trainer was restarted"
    # The new engine has the old one's layout: its handshake finds the plan in the cache.
    assert trainer.live().call(plan_reused)[0] is True
    pending, receives = step_and_receive(trainer, engines)
    reports = [r.result(SYNC_TIMEOUT * 3) for r in receives]
    trainer_side = pending.result(SYNC_TIMEOUT * 3)
    version = trainer_side[0]["sync"]["version"]
    assert bases(trainer_side, reports) == {None}  # a restarted server, a new handshake: a full sync
    assert all(not w["incomplete"] and w["version"] == version for r in reports for w in r), reports
    assert [e.weight_version() for e in engines] == [str(version)] * 2
    assert digests(engines[0]) == digests(engines[1])  # the same layout, both the trainer's weights
    print(f"\nrestarted server rejoined (new handshake and group, cached plan) in {rejoined_in:.1f} s")


def test_after_a_full_sync_the_next_syncs_apply_on_it_and_leave_both_servers_exact(
    servers: list[Server], trainer: Trainer, model: Path, tmp_path: Path
) -> None:
    engines = [s.engine for s in servers]
    last = int(engines[0].weight_version())  # the previous test's full sync
    for _ in range(2):
        pending, receives = step_and_receive(trainer, engines)
        reports = [r.result(SYNC_TIMEOUT * 3) for r in receives]
        trainer_side = pending.result(SYNC_TIMEOUT * 3)
        version = trainer_side[0]["sync"]["version"]
        assert bases(trainer_side, reports) == {last}, (trainer_side, reports)
        assert all(not w["incomplete"] and w["version"] == version for r in reports for w in r), reports
        last = version
    checkpoint = tmp_path / "delta"
    trainer.live().call(save_checkpoint, str(checkpoint), str(model))
    synced = [digests(e) for e in engines]
    apply_checkpoint(engines, str(checkpoint))
    assert [digests(e) for e in engines] == synced, "a delta sync left a server off the trainer's weights"


def test_vllms_weight_transfer_routes_drive_a_sync_and_report_its_weight_version(
    servers: list[Server], trainer: Trainer, model: Path, tmp_path: Path
) -> None:
    engine = servers[0].engine  # started with --weight-transfer-config '{"backend": "rollout_sync"}'
    address = f"tcp://127.0.0.1:{free_port()}"
    pending = trainer.live().submit(reattach, address, 1, SYNC_TIMEOUT)
    init_info = {"first_rank": TRAINERS, "address": address, "engine": 0, "token": TOKEN, "maps": "verify"}
    engine.request("/init_weight_transfer_engine", {"init_info": {**init_info, "timeout": SYNC_TIMEOUT}})
    pending.result(SYNC_TIMEOUT * 3)
    for _ in range(2):
        engine.request("/pause", {})
        try:
            engine.request("/start_weight_update", {})
            trainer.step += 1
            pending = trainer.live().submit(train_step, trainer.step)
            engine.request("/update_weights", {"update_info": {}}, timeout=SYNC_TIMEOUT * 3)
            version = str(pending.result(SYNC_TIMEOUT * 3)[0]["sync"]["version"])
            engine.request("/finish_weight_update", {"weight_version": version})
        finally:
            engine.request("/resume", {})
        assert engine.weight_version() == version
    checkpoint = tmp_path / "weight_transfer"
    trainer.live().call(save_checkpoint, str(checkpoint), str(model))
    synced = digests(engine)
    setup_engines([engine], first_rank=TRAINERS)
    apply_checkpoint([engine], str(checkpoint))
    assert digests(engine) == synced, "the server does not hold exactly the trainer's weights"
    assert len(engine.complete_greedy(DEFAULT_PROMPTS[:1], max_tokens=4)[0]) == 4
