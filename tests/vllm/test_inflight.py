"""Syncs into an ``AsyncLLM`` that keeps generating (``vllm_plugin.async_driver``): a real TP-2 engine of the
tiny dense model, its linear layers packed (by vLLM where this CPU packs, else by the contract stand-in),
and a 2-rank ZeRO-3 DeepSpeed trainer, joined with ``atomic=True``.

A greedy request started on version v and frozen mid-generation while version v+1 lands keeps its first
tokens (they equal a run on version v alone), and vLLM's ``weight_versions`` spans on its output put the
boundary exactly where it resumed: with ``kv="recompute"`` its tokens after the boundary equal what the
engine, holding v+1, generates greedily from the prompt and its first tokens. Also: many requests across
two syncs, a delta sync, no reuse after a sync of a prefix the old weights cached, and a sync that fails
while requests are frozen (they resume on the old weights, the version does not move, nothing hangs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankPool, free_port
from testbed.trainer_ranks import attach, setup, train_step
from tests.e2e.e2e_steps import TRAINER_ENV, save_checkpoint
from tests.harness.vllm_engines import omp_threads_bind
from vllm_plugin.async_driver import Blocking, connect_engine_async, receive_sync_async, setup_engines_async
from vllm_plugin.driver import apply_checkpoint, weight_digests

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]

TOKEN = "inflight-test"
TP = 2
TRAINERS = 2
TIMEOUT = 20.0  # every wait of the sync group
PROMPTS = ([5, 6, 7, 8, 9], [100, 200, 300], [11, 12, 13, 14], [400, 401], [7, 7, 7], [900, 17, 23, 42])
_T = TypeVar("_T")


class Loop:
    """An asyncio event loop on its own thread: the engine lives on it, tests submit coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inflight-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, _T], timeout: float = 300.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Setup:
    def __init__(self, loop: Loop, engine: Any, pool: RankPool, model: Path, tmp: Path) -> None:
        self.loop, self.engine, self.pool, self.model, self.tmp = loop, engine, pool, model, tmp
        self.step = 0
        self.address = ""

    def handshake(self, delta: bool = False) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        pending = self.pool.submit(attach, self.address, TOKEN, 1, 1, "balanced", TIMEOUT, None, True, delta)
        self.loop.run(
            connect_engine_async(self.engine, self.address, 0, token=TOKEN, timeout=TIMEOUT, atomic=True)
        )
        pending.result(120)

    def train_and_sync(self, *, mode: str = "keep", kv: str = "keep") -> list[list[dict[str, Any]]]:
        """One optimizer step (its hook syncs) while the engine receives: the engine's reports."""
        self.step += 1
        pending = self.pool.submit(train_step, self.step)
        reports = self.loop.run(receive_sync_async([self.engine], mode=mode, kv=kv))  # type: ignore[arg-type]
        trained = pending.result(120)
        assert trained[0]["sync"]["version"] == reports[0][0]["version"], (trained, reports)
        return reports

    def greedy(
        self, prompt: Sequence[int], n: int, rid: str, seen: Callable[[int], None] | None = None
    ) -> Any:
        return self.loop.submit(generate(self.engine, prompt, n, rid, seen))

    def holds_trainer_weights(self, name: str) -> bool:
        """The trainer's own checkpoint written through the maps changes no parameter of the engine."""
        out = self.tmp / name
        self.pool.call(save_checkpoint, str(out), str(self.model))
        engine = Blocking(self.engine, self.loop.loop)
        before = weight_digests(engine)
        apply_checkpoint([engine], str(out))
        return weight_digests(engine) == before


async def generate(
    engine: Any, prompt: Sequence[int], n: int, rid: str, seen: Callable[[int], None] | None
) -> Any:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    last = None
    async for out in engine.generate({"prompt_token_ids": list(prompt)}, params, rid):
        last = out
        if seen is not None:
            seen(len(out.outputs[0].token_ids))
    assert last is not None and last.finished
    return last.outputs[0]


def detach(ctx: Any) -> None:
    ctx.state.pop("sync").detach()


def spans(output: Any) -> list[tuple[str, int, int]]:
    return [(s.version, s.start, s.end) for s in output.weight_versions or []]


@pytest.fixture(scope="module")
def inflight(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    import os

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind(TP))
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model = tiny_model("dense")
    loop = Loop()
    args = AsyncEngineArgs(
        model=str(model),
        tensor_parallel_size=TP,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=64 * 2**20,
        block_size=32,  # the CPU's 128 would let no test prompt fill a block the prefix cache keeps
        seed=0,
        worker_extension_cls="tests.harness.vllm_ext.TestWorkerExtension",
        weight_transfer_config={"backend": "rollout_sync"},  # the last test: vLLM's own API
    )

    async def start() -> Any:
        return AsyncLLM.from_engine_args(args)

    engine = loop.run(start())
    pool = RankPool(TRAINERS, env=TRAINER_ENV, timeout=600)
    try:
        loop.run(engine.collective_rpc("rs_harness_request_amx"))  # vLLM's AMX bug: see the harness
        before = loop.run(engine.collective_rpc("rs_harness_packs"))
        if any(p["empty_weight"] == 0 for p in before):  # this CPU keeps plain weights: pack them
            loop.run(engine.collective_rpc("rs_harness_pack_linears"))
        loop.run(setup_engines_async([engine], first_rank=TRAINERS))
        # lr 1e-2: each step changes the greedy tokens (a sync that changes nothing shows nothing)
        pool.call(setup, DeepSpeedSpec("dense", 3, lr=1e-2), str(model))
        s = Setup(loop, engine, pool, model, tmp_path_factory.mktemp("inflight"))
        s.handshake()
        s.train_and_sync()  # version 1, nothing in flight
        yield s
    finally:
        pool.close(kill=True)
        with contextlib.suppress(Exception):
            engine.shutdown(timeout=30)  # past vLLM's worker grace; see examples/async_grpo.py
        loop.close()


def _frozen_mid_request(s: Setup, kv: str, n: int = 48, after: int = 8) -> tuple[list[int], Any, list[int]]:
    """A greedy request of ``n`` tokens on the current version, the next version synced in keep mode once it
    has ``after`` tokens; (the tokens the current version alone gives, the request's output, the prompt)."""
    prompt = list(PROMPTS[0])
    reference = list(s.loop.run(generate(s.engine, prompt, n, f"ref-{s.step}-{kv}", None)).token_ids)
    reached = threading.Event()
    running = s.greedy(prompt, n, f"frozen-{s.step}-{kv}", lambda k: reached.set() if k >= after else None)
    assert reached.wait(120), "the request produced no tokens"
    s.train_and_sync(mode="keep", kv=kv)
    return reference, running.result(120), prompt


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_request_frozen_by_a_sync_keeps_its_tokens_and_reports_the_exact_boundary(inflight: Setup, kv: str):
    old = str(inflight.step)
    reference, output, prompt = _frozen_mid_request(inflight, kv)
    new = str(inflight.step)
    tokens = list(output.token_ids)
    (first, second) = spans(output)
    assert (
        first[0] == old and second[0] == new and first[1] == 0 and first[2] == second[1] and second[2] == 48
    )
    boundary = first[2]
    assert 8 <= boundary < 48, boundary
    assert tokens[:boundary] == reference[:boundary], "tokens before the sync differ from the old version's"
    assert tokens[boundary:] != reference[boundary:], "the sync changed nothing the request could see"
    if kv == "recompute":  # no token over mixed-version KV: exactly what the new version gives from there
        resumed = inflight.loop.run(
            generate(inflight.engine, prompt + tokens[:boundary], 48 - boundary, f"check-{new}", None)
        )
        assert tokens[boundary:] == list(resumed.token_ids)
    assert inflight.holds_trainer_weights(f"v{new}-{kv}")


def test_many_requests_across_two_syncs_carry_contiguous_spans_of_increasing_versions(inflight: Setup):
    first = inflight.step
    running = []
    generating = threading.Event()  # the last request has its first token: it is mid-generation
    for i, prompt in enumerate(PROMPTS):
        time.sleep(0.05 * i)  # staggered starts
        last = i == len(PROMPTS) - 1
        seen = (lambda n: generating.set() if n >= 1 else None) if last else None
        running.append(inflight.greedy(prompt, 96, f"many-{first}-{i}", seen))
    # The sync pauses the engine as it begins: at least the last request is then between its first and its
    # 96th token (on a fast CPU the tiny model makes 96 tokens in about 0.25 s: a fixed sleep here let every
    # request finish first).
    assert generating.wait(120), "the last request produced no token"
    inflight.train_and_sync()
    inflight.train_and_sync()
    late = inflight.greedy(PROMPTS[1], 8, f"late-{first}", None).result(120)
    outputs = [f.result(180) for f in running]
    versions = [str(first), str(first + 1), str(first + 2)]
    changed = 0
    for out in outputs:
        got = spans(out)
        assert got[0][1] == 0 and got[-1][2] == 96 and all(a[2] == b[1] for a, b in itertools.pairwise(got))
        assert [v for v, _, _ in got] == sorted({v for v, _, _ in got}, key=versions.index), got
        assert {v for v, _, _ in got} <= set(versions), got
        changed += len(got) > 1
    assert changed, "no request spanned a sync"
    assert spans(late) == [(versions[-1], 0, 8)]


def test_a_delta_sync_into_frozen_requests_lands_bit_for_bit(inflight: Setup):
    inflight.pool.call(detach)
    inflight.handshake(delta=True)
    inflight.train_and_sync()  # full: a new handshake
    reference, output, _ = _frozen_mid_request(inflight, "keep")
    first, _ = spans(output)
    assert list(output.token_ids)[: first[2]] == reference[: first[2]]
    assert inflight.holds_trainer_weights(f"delta-v{inflight.step}")


def test_a_request_after_a_sync_does_not_reuse_a_prefix_the_old_weights_cached(inflight: Setup):
    """An 80-token prompt (two full blocks of 32) generated to the end on the old version leaves its blocks in
    the prefix cache; after a sync that freezes another request (so vLLM's own reset cannot run), the same
    prompt gives what the engine gives once its cache is emptied: the old blocks were forgotten."""
    prompt = [(7 * i + 3) % 900 + 4 for i in range(80)]
    inflight.loop.run(generate(inflight.engine, prompt, 8, f"cached-{inflight.step}", None))
    _frozen_mid_request(inflight, "keep")
    after = list(
        inflight.loop.run(generate(inflight.engine, prompt, 8, f"after-{inflight.step}", None)).token_ids
    )
    assert inflight.loop.run(inflight.engine.reset_prefix_cache())  # idle now: vLLM's own reset runs
    clean = list(
        inflight.loop.run(generate(inflight.engine, prompt, 8, f"clean-{inflight.step}", None)).token_ids
    )
    assert after == clean


def test_a_sync_that_fails_while_requests_are_frozen_resumes_them_on_the_old_weights(inflight: Setup):
    """The engine pauses and waits for a sync no trainer rank sends: its workers time out, the requests
    resume on the old weights (the worker was atomic), the version does not move, nothing hangs."""
    version = str(inflight.step)
    digests = weight_digests(Blocking(inflight.engine, inflight.loop.loop))
    reference = list(inflight.loop.run(generate(inflight.engine, PROMPTS[2], 48, "fail-ref", None)).token_ids)
    reached = threading.Event()
    running = inflight.greedy(PROMPTS[2], 48, "fail-frozen", lambda k: reached.set() if k >= 8 else None)
    assert reached.wait(120)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"SyncTimeoutError|made no progress|timed out"):
        inflight.loop.run(receive_sync_async([inflight.engine]), timeout=TIMEOUT * 4)
    assert time.monotonic() - started < TIMEOUT + 15
    output = running.result(120)
    assert list(output.token_ids) == reference and spans(output) == [(version, 0, 48)]
    assert inflight.loop.run(inflight.engine.get_weight_version()) == version
    assert weight_digests(Blocking(inflight.engine, inflight.loop.loop)) == digests


def test_vllms_weight_transfer_api_in_keep_mode_freezes_requests_and_versions_them_exactly(inflight: Setup):
    """The same through vLLM's weight-transfer API, driven as vLLM's RL examples drive it: pause with
    ``mode="keep"``, ``start_weight_update``, ``update_weights``, ``finish_weight_update(weight_version=...)``,
    resume. (A new handshake: the failed sync above closed the extension's link.)"""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    s = inflight
    s.pool.call(detach)
    address = f"tcp://127.0.0.1:{free_port()}"
    pending = s.pool.submit(attach, address, TOKEN, 1, 1, "balanced", TIMEOUT, None, True, False)
    init = {
        "first_rank": TRAINERS,
        "address": address,
        "engine": 0,
        "token": TOKEN,
        "timeout": TIMEOUT,
        "atomic": True,
    }
    s.loop.run(s.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init)))
    pending.result(120)
    old = s.loop.run(s.engine.get_weight_version())
    prompt = list(PROMPTS[3])
    reference = list(s.loop.run(generate(s.engine, prompt, 48, "api-ref", None)).token_ids)
    reached = threading.Event()
    running = s.greedy(prompt, 48, "api-frozen", lambda k: reached.set() if k >= 8 else None)
    assert reached.wait(120)
    s.step += 1
    trained = s.pool.submit(train_step, s.step)

    async def update() -> str:
        engine = s.engine
        await engine.pause_generation(mode="keep", clear_cache=False)
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info={}))
        result = await asyncio.get_running_loop().run_in_executor(None, trained.result, 120)
        version = str(result[0]["sync"]["version"])
        await engine.finish_weight_update(weight_version=version)
        await engine.resume_generation()
        return version

    new = s.loop.run(update())
    output = running.result(120)
    (first, second) = spans(output)
    assert first[0] == old and second[0] == new and first[2] == second[1] and second[2] == 48, spans(output)
    assert 8 <= first[2] < 48 and list(output.token_ids)[: first[2]] == reference[: first[2]]
