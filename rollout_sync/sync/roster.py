"""Who is who in a sync group, and which peer a failed sync is to blame on.

The coordinator knows every rank's place (trainer rank, or engine ``e`` worker ``w``) and each peer's
process (hostname, pid and machine key, from its hello: ``sync.machine``); it sends this roster in every
welcome. Ranks share a machine when their machine keys are equal, never by hostname alone. When a sync fails, a rank
names the peers at fault: the ranks the error names (``sending to rank 3``, a commit record of rank 3), and
the peers on this host whose process is gone (an allgather that failed says only that *a* peer left). With
no such evidence it lists every engine with its ranks, so an error never leaves the engines unnamed.

Pure apart from ``process_gone`` (reads ``/proc``); no torch, no vLLM.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .machine import machine_key, network_key

__all__ = [
    "GRACE_S",
    "RosterEntry",
    "blame",
    "decode_roster",
    "device_kind",
    "encode_roster",
    "in_process_peers",
    "process_gone",
    "same_host_peers",
    "this_process",
]


@dataclass(frozen=True)
class RosterEntry:
    rank: int  # global rank in the sync group
    engine: int | None  # None for trainer ranks
    local_rank: int  # the trainer rank, or the worker's rank in its engine
    host: str  # the hostname, for messages
    pid: int
    machine: str = ""  # the machine key (``sync.machine``); empty: unknown, shares nothing
    address: str = ""  # the address its group connections use (its route to the coordinator)

    @property
    def role(self) -> str:
        if self.engine is None:
            return f"trainer rank {self.local_rank}"
        return f"engine {self.engine} worker {self.local_rank}"

    @property
    def where(self) -> str:
        if not self.host:
            return "process unknown"
        at = f" ({self.address})" if self.address else ""
        return f"pid {self.pid} on {self.host}{at}"


def this_process() -> dict[str, Any]:
    """The hello fields that let the coordinator name this process in a roster and tell which ranks share
    a machine (``machine``) or a loopback interface (``network``)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "machine": machine_key(),
        "network": network_key(),
    }


def _here(entry: RosterEntry) -> bool:
    return bool(entry.machine) and entry.machine == machine_key()


def device_kind(tensors: Iterable[Any]) -> str | None:
    """The device type of a rank's storages for its hello (``"cpu"``, ``"cuda"``; ``"cpu+cuda"`` when
    mixed; None when it has none), so that the coordinator can check the backend carries it."""
    kinds = {
        t.device.type for t in tensors if getattr(t, "device", None) is not None and t.device.type != "meta"
    }
    return "+".join(sorted(kinds)) or None


def in_process_peers(rank: int, roster: Mapping[int, RosterEntry]) -> frozenset[int]:
    """The other ranks of the roster that run in this very process (a trainer rank and a vLLM worker of
    TRL's colocate mode): their messages are in-process copies."""
    pid = os.getpid()
    return frozenset(r for r, e in roster.items() if r != rank and _here(e) and e.pid == pid)


def same_host_peers(rank: int, roster: Mapping[int, RosterEntry]) -> dict[int, int]:
    """The ranks of the roster on this host in other processes, with their pids: their messages' bytes can
    go through shared memory."""
    pid = os.getpid()
    return {r: e.pid for r, e in roster.items() if r != rank and _here(e) and e.pid and e.pid != pid}


def encode_roster(entries: Sequence[RosterEntry]) -> list[list[Any]]:
    """JSON-able (welcome field ``roster``)."""
    return [[e.rank, e.engine, e.local_rank, e.host, e.pid, e.machine, e.address] for e in entries]


def decode_roster(raw: Any) -> dict[int, RosterEntry]:
    """The roster of a welcome; an older coordinator sends none (empty roster)."""
    out: dict[int, RosterEntry] = {}
    if not isinstance(raw, list):
        return out
    for item in raw:
        rank, engine, local_rank, host, pid, machine, address = item
        out[int(rank)] = RosterEntry(
            int(rank),
            None if engine is None else int(engine),
            int(local_rank),
            str(host),
            int(pid),
            str(machine),
            str(address),
        )
    return out


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows the last ')'.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


_PEER_RANK = re.compile(r"(?:to|from|on|of) rank (\d+)|rank (\d+): ")


def _named_ranks(text: str, me: int) -> set[int]:
    found = set()
    for m in _PEER_RANK.finditer(text):
        found.add(int(m.group(1) or m.group(2)))
    found.discard(me)
    return found


def _engines(roster: Mapping[int, RosterEntry], ranks: Sequence[int]) -> str:
    """The trainer ranks among ``ranks`` one by one, and each engine that one of ``ranks`` belongs to as a
    whole (every rank and worker of it: an engine with one worker lost is lost)."""
    trainers = [roster[r] for r in sorted(ranks) if roster[r].engine is None]
    engines = sorted({e for r in ranks if (e := roster[r].engine) is not None})
    parts = [f"{e.role} (global rank {e.rank}, {e.where})" for e in trainers]
    for engine in engines:
        entries = sorted((e for e in roster.values() if e.engine == engine), key=lambda e: e.rank)
        workers = ", ".join(f"worker {e.local_rank} {e.where}" for e in entries)
        ranks_text = ", ".join(str(e.rank) for e in entries)
        parts.append(f"engine {engine} (global ranks {ranks_text}: {workers})")
    return "; ".join(parts)


def _ranks(ranks: set[int]) -> str:
    return ("global rank " if len(ranks) == 1 else "global ranks ") + ", ".join(str(r) for r in sorted(ranks))


GRACE_S = 3.0
"""How long a failure that names no peer waits for a local peer's process to be gone: a peer being killed
resets its connections before the kernel has reaped it (a killed server's workers exit one after another)."""


def blame(
    text: str,
    me: int,
    roster: Mapping[int, RosterEntry],
    gone: Callable[[int], bool] = process_gone,
    machine: str | None = None,
    grace: float = GRACE_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """A sentence naming the peers a failure of rank ``me`` is to blame on (see the module doc); empty
    without a roster. ``text``: the failure's message; ``gone(pid)``: whether a process of this machine
    (``machine``: its key, this process's by default) exited. An
    engine is named whole, whichever of its workers the evidence points at (when a server is killed, its
    workers exit one after another: the first failure may see one of them gone), followed by that
    evidence. Where the error names no peer and no local peer is gone yet, it looks again for up to
    ``grace`` seconds. With no evidence at all it lists the peers on other hosts (a cut link, a lost host),
    else every engine (and, on a rollout rank, every trainer rank)."""
    if not roster:
        return ""
    machine = machine_key() if machine is None else machine
    named = {r for r in _named_ranks(text, me) if r in roster}
    local = {r: e.pid for r, e in roster.items() if r != me and e.machine == machine and e.pid > 0}
    dead = {r for r, pid in local.items() if gone(pid)}
    deadline = clock() + grace
    while not dead and not named and local and clock() < deadline:
        sleep(0.05)
        dead = {r for r, pid in local.items() if gone(pid)}
    if dead:
        return f"failed peer(s): {_engines(roster, sorted(dead))} (process gone: {_ranks(dead)})"
    if named:
        return f"failed peer(s): {_engines(roster, sorted(named))} (named by the error: {_ranks(named)})"
    away = [r for r, e in roster.items() if r != me and e.machine != machine]
    if away:  # a cut link or a lost host is between this rank and these
        return f"the failed peer is not known; peers of this sync on other hosts: {_engines(roster, away)}"
    me_rollout = me in roster and roster[me].engine is not None
    listed = [r for r, e in roster.items() if e.engine is not None or (me_rollout and r != me)]
    return f"the failed peer is not known; peers of this sync: {_engines(roster, listed)}"
