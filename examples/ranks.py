"""A one-program job's trainer ranks: child processes that run the commands the program sends them.

    with Ranks(2, env={"DS_ACCELERATOR": "cpu"}) as ranks:
        ranks.call(setup, model)               # setup(state, rank, world, model) on every rank; waits
        pending = ranks.submit(step, batch)    # starts it on every rank and returns at once
        ...                                    # the program meanwhile drives its vLLM engine
        results = pending.result(timeout=300)  # one result per rank

Each rank is a process started with ``spawn``, with what a launcher sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), keeping a ``state`` dict across commands. Commands are
module-level functions ``fn(state, rank, world, *args)``. A rank's exception comes back with its traceback,
a rank that dies or does not answer in time makes the call raise, and leaving the ``with`` block stops them
all. A job across machines starts its ranks with the ``deepspeed`` launcher or ``torchrun`` instead
(``examples/two_programs``), or as Ray actors (``examples/ray_grpo.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Pending", "Ranks", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(rank: int, world: int, env: Mapping[str, str], conn: Connection) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    state: dict[str, Any] = {}
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command is None:
            return
        fn, args = command
        try:
            conn.send((True, fn(state, rank, world, *args)))
        except BaseException:
            conn.send((False, traceback.format_exc()))


class Pending:
    """A command running on every rank."""

    def __init__(self, name: str, conns: list[Connection], procs: list[Any]) -> None:
        self.name, self.conns, self.procs = name, conns, procs

    def result(self, timeout: float) -> list[Any]:
        """Each rank's result, in rank order; raises ``RuntimeError`` naming the rank that raised, died or
        did not answer within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        results = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                raise RuntimeError(f"trainer rank {rank}: {self.name} did not answer within {timeout:g} s")
            try:
                ok, value = conn.recv()
            except EOFError:
                code = self.procs[rank].exitcode
                raise RuntimeError(
                    f"trainer rank {rank} died during {self.name} (exit code {code})"
                ) from None
            if not ok:
                raise RuntimeError(f"trainer rank {rank} raised in {self.name}:\n{value}")
            results.append(value)
        return results


class Ranks:
    def __init__(self, world: int, env: Mapping[str, str] | None = None, timeout: float = 600.0) -> None:
        context = mp.get_context("spawn")
        launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
        self.timeout = timeout
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_serve, args=(rank, world, launcher, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Pending:
        for conn in self.conns:
            conn.send((fn, args))
        return Pending(fn.__name__, self.conns, self.procs)

    def call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return self.submit(fn, *args).result(self.timeout)

    def close(self) -> None:
        """Ask every rank to stop; kill the ones still running 10 s later."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that rank is gone already
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
