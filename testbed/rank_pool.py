"""A pool of long-lived rank processes that run commands, for programs that drive a training job and a
vLLM engine from one parent process (the end-to-end tests, the GRPO example, the benchmarks).

    with RankPool(2, env={"DS_ACCELERATOR": "cpu"}) as pool:
        pool.call(setup_engine, config)          # runs setup_engine(ctx, config) on every rank, waits
        handle = pool.submit(train_step, batch)  # starts it on every rank, returns at once
        ...                                      # the parent meanwhile drives the vLLM engine
        losses = handle.result(timeout=120)

Each rank is a process started with ``spawn`` that has ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` set (what ``deepspeed.init_distributed`` reads) and keeps a ``state`` dict
across commands. Commands are module-level functions ``fn(ctx, *args, **kwargs)``; arguments and results go
over a local pipe (this is test and demo plumbing between processes of one program, not the sync's wire).
A rank's exception comes back with its traceback; a rank that dies or runs past the timeout makes the call
raise, and closing the pool kills what still runs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, cast

__all__ = ["RankContext", "RankError", "RankPool", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankError(RuntimeError):
    """A rank raised (its traceback is in the message), died, or did not answer in time."""


@dataclass
class RankContext:
    rank: int
    world_size: int
    state: dict[str, Any] = field(default_factory=dict)


def _serve(rank: int, world: int, env: Mapping[str, str], conn: Connection) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    ctx = RankContext(rank, world)
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command is None:
            return
        fn, args, kwargs = command
        try:
            conn.send(("ok", fn(ctx, *args, **kwargs)))
        except BaseException as exc:
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Pending:
    """A command running on every rank."""

    def __init__(self, pool: RankPool, name: str) -> None:
        self.pool = pool
        self.name = name
        self._results: dict[int, Any] = {}
        self._errors: dict[int, str] = {}
        self._done = False

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order; raises RankError if any rank failed."""
        import time

        timeout = self.pool.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        waiting = {self.pool._conns[r]: r for r in range(self.pool.world_size) if r not in self._results}
        waiting = {c: r for c, r in waiting.items() if r not in self._errors}
        while waiting:
            left = deadline - time.monotonic()
            ready = wait(list(waiting), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                late = sorted(waiting.values())
                self.pool.close(kill=True)
                raise RankError(
                    f"{self.name}: rank(s) {late} did not finish within {timeout:g} s (pool killed)"
                )
            for c in ready:
                conn = cast(Connection, c)
                r = waiting.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self._errors[r] = f"rank {r} died (exit code {self.pool._procs[r].exitcode})"
                    continue
                if status == "ok":
                    self._results[r] = value
                else:
                    self._errors[r] = str(value)
        self.pool._busy = False
        if self._errors:
            raise RankError(
                f"{self.name} failed:\n" + "\n".join(self._errors[r] for r in sorted(self._errors))
            )
        return [self._results[r] for r in range(self.pool.world_size)]


class RankPool:
    """``launcher``: an executable that runs its arguments as a Python command line somewhere else (an
    emulated host: ``testbed.hosts.Hosts.python_launcher``); the ranks start through it. ``daemon``: ranks
    that start processes of their own (a vLLM engine) must not be daemonic."""

    def __init__(
        self,
        world_size: int,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 600.0,
        launcher: str | None = None,
        daemon: bool = True,
    ) -> None:
        from multiprocessing import spawn

        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        base.update(env or {})
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        python = spawn.get_executable()
        try:
            if launcher is not None:
                spawn.set_executable(launcher)  # global to spawn: only while these ranks start
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(rank, world_size, base, child), daemon=daemon)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        finally:
            spawn.set_executable(python)
        self._busy = False
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending:
        if self._closed:
            raise RankError("the rank pool is closed")
        if self._busy:
            raise RankError("a command is still running on the ranks; wait for its result first")
        self._busy = True
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return Pending(self, getattr(fn, "__name__", repr(fn)))

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        return self.submit(fn, *args, **kwargs).result(timeout)

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's process at once (fault tests)."""
        self._procs[rank].kill()

    def close(self, kill: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not kill:
            for conn in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
            for proc in self._procs:
                proc.join(10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)
