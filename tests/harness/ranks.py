"""Run a function on several ranks, each in its own process, over one process group.

``run_on_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (multiprocessing ``spawn``); rank
``r`` calls ``fn(r, world_size, group, *args)`` where ``group`` is a process group object built the way the
product builds its cross-process group (``TCPStore`` served by this parent process + the backend's
process group over a ``PrefixStore``; not registered with ``torch.distributed``). The parent returns the
ranks' return values (which must pickle), re-raises the first failing rank's exception with every failing
rank's traceback attached, and never hangs: after ``timeout`` seconds, or a few seconds after a rank failed,
every child still running is killed and the call raises.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["RankFailed", "RanksTimedOut", "run_on_ranks"]

_GRACE_AFTER_FAILURE = 10.0


class RankFailed(RuntimeError):
    """A rank raised, or died without reporting, and its exception could not be re-raised as is."""


class RanksTimedOut(TimeoutError):
    """Ranks still running when the timeout ran out (they were killed)."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    group_timeout: float,
    threads: int | None,
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    try:
        import torch

        from rollout_sync.transport.core.groups import connect_store, new_group

        if threads is not None:
            torch.set_num_threads(threads)
        store = connect_store("127.0.0.1", port, world_size, is_master=False, timeout=group_timeout)
        group = new_group(store, rank, world_size, backend=backend, timeout=group_timeout, prefix="ranks")
        result = fn(rank, world_size, group, *args)
        message: tuple[Any, ...] = ("ok", result)
    except BaseException as e:
        text = traceback.format_exc()
        try:
            blob = pickle.dumps(e)
        except Exception:
            blob = None
        message = ("error", text, blob)
    try:
        conn.send(message)
    except Exception as e:  # the result does not pickle
        conn.send(("error", f"rank {rank} returned a value that does not pickle: {e!r}", None))
    conn.close()
    os._exit(0)  # skip teardown of the group (a dead peer must not make this exit hang)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    group_timeout: float = 60.0,
    may_die: Collection[int] = (),
    threads: int | None = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, group, *args)`` on ``world_size`` spawned ranks; return their results in
    rank order. A rank in ``may_die`` may exit without reporting (its result is ``None``).
    ``group_timeout`` is the group's own timeout (store and backend); ``threads`` caps torch's intra-op
    threads per rank (the machine is shared)."""
    from torch.distributed import TCPStore

    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    store = TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    readers: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, store.port, backend, group_timeout, threads, args, writer),
                daemon=True,
                name=f"rank-{rank}",
            )
            p.start()
            writer.close()
            procs.append(p)
            readers[reader] = rank
        return _collect(procs, readers, timeout, set(may_die))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for reader in readers:
            reader.close()
        del store


def _collect(
    procs: list[Any], readers: dict[Connection, int], timeout: float, may_die: set[int]
) -> list[Any]:
    world = len(procs)
    results: list[Any] = [None] * world
    done: set[int] = set()
    failures: dict[int, tuple[str, bytes | None]] = {}
    deadline = time.monotonic() + timeout
    open_readers = dict(readers)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}

    def died(rank: int) -> None:
        nonlocal deadline
        done.add(rank)
        if rank not in may_die:
            code = procs[rank].exitcode
            failures[rank] = (f"rank {rank} died without reporting (exit code {code})", None)
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)

    while len(done) < world:
        now = time.monotonic()
        if now >= deadline:
            break
        ready = wait([*open_readers, *sentinels], timeout=deadline - now)
        for obj in ready:
            if obj in open_readers:
                rank = open_readers.pop(obj)  # type: ignore[call-overload]
                try:
                    message = obj.recv()  # type: ignore[union-attr]
                except EOFError:  # died without reporting: its sentinel tells, or told already
                    if rank not in sentinels.values() and rank not in done:
                        died(rank)  # its sentinel came first and left it to this pipe's end
                    continue
                if message[0] == "ok":
                    results[rank] = message[1]
                else:
                    failures[rank] = (message[1], message[2])
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
                done.add(rank)
            elif obj in sentinels:
                rank = sentinels.pop(obj)  # type: ignore[call-overload]
                reader = next((r for r, k in open_readers.items() if k == rank), None)
                if reader is not None and reader.poll():
                    continue  # its report is waiting in the pipe; read it next time
                if reader is not None:
                    open_readers.pop(reader)
                if rank not in done:
                    died(rank)
    missing = sorted(set(range(world)) - done)
    if failures:
        _raise(failures, missing)
    if missing:
        raise RanksTimedOut(f"ranks {missing} of {world} did not finish within {timeout:g} s (killed)")
    return results


def _raise(failures: dict[int, tuple[str, bytes | None]], missing: list[int]) -> None:
    text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, (tb, _) in sorted(failures.items()))
    if missing:
        text += f"\n--- ranks {missing} were still running and were killed ---"
    first = min(failures)
    blob = failures[first][1]
    error: BaseException | None = None
    if blob is not None:
        try:
            error = pickle.loads(blob)
        except Exception:
            error = None
    if isinstance(error, Exception):
        error.add_note(f"raised on rank {first}; tracebacks of the failing ranks:\n{text}")
        raise error
    raise RankFailed(f"rank {first} failed:\n{text}")
