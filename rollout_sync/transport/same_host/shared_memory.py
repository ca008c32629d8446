"""Staging slots in shared memory, for pairs of ranks on one host in different processes (CPU).

A pair of same-host ranks keeps its plan and schedule; only where its packed messages' bytes live changes.
The sender's send slots for a peer are one file in ``/dev/shm`` that both processes map: the sender packs
straight into it, the receiver unpacks straight out of it (two copies per element, no socket), and only a
few bytes of signal per message still cross the process group: "round ``k`` is packed" (the message's tag)
and "round ``k`` is unpacked, its slot is free" (tag + 1). The signals keep every guarantee of the process
group path: each wait is bounded by the timeout, a dead peer fails the wait naming it, and a send syscall
orders the slot's bytes before the signal.

Lifetime: the sender creates the file (named after its pid, the group, the pair and the schedule's slot
sizes) before its first signal; the receiver opens it after that signal and unlinks it at once, so while
syncs run nothing is left in ``/dev/shm`` (the mappings stay). The sender also unlinks it when its
executor closes, and every creation first removes files left by processes that no longer exist (a
process killed with SIGKILL before its peer opened them).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..core.schedule import Schedule

__all__ = [
    "SHM_PREFIX",
    "SIGNAL_ONLY",
    "SameHost",
    "SharedSegments",
    "SharedSlots",
    "pid_namespace",
    "shm_dir",
    "sweep_stale",
]

SHM_PREFIX = "rollout-sync-"
_NAME = re.compile(r"^rollout-sync-(\d+)-(?:n(\d+)-)?")


def pid_namespace() -> str:
    """The number of this process's PID namespace (empty where unknown). Segment names carry it: a
    ``/dev/shm`` shared by two PID namespaces (containers with a host IPC mount) then never has a live
    process's segment swept by a process that cannot see that pid."""
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))
    except OSError:
        return ""


def shm_dir() -> Path:
    """Where shared segments live: ``/dev/shm`` (memory), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale(directory: Path | None = None) -> list[str]:
    """Remove segments whose creating process, in this PID namespace, is gone; the names removed."""
    directory = directory or shm_dir()
    removed = []
    own = pid_namespace()
    for path in directory.glob(SHM_PREFIX + "*"):
        match = _NAME.match(path.name)
        if match is None or (match.group(2) or own) != own or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed


class SameHost:
    """The ranks of group ``group_id`` on this host in other processes (``peers``: rank -> pid)."""

    def __init__(self, group_id: str, rank: int, peers: Mapping[int, int]) -> None:
        self.group_id = group_id
        self.rank = rank
        self.peers = dict(peers)


class SharedSlots:
    """The shared segments of one rank: those it created (its send slots to each same-host peer) and those
    it opened (its peers' send slots to it). A segment is reused while the schedule's sizes stay the same."""

    def __init__(self, same_host: SameHost) -> None:
        self.same_host = same_host
        self.directory = shm_dir()
        self.created: dict[int, tuple[str, torch.Tensor]] = {}  # peer -> (path, mapping)
        self.opened: dict[int, tuple[str, torch.Tensor]] = {}

    def _path(self, src: int, dst: int, nbytes: int, key: str) -> str:
        pid = os.getpid() if src == self.same_host.rank else self.same_host.peers[src]
        digest = hashlib.sha256(f"{key}:{nbytes}".encode()).hexdigest()[:12]
        namespace = pid_namespace()
        tag = f"n{namespace}-" if namespace else ""
        name = f"{SHM_PREFIX}{pid}-{tag}{self.same_host.group_id}-{src}-{dst}-{digest}"
        return str(self.directory / name)

    @property
    def created_bytes(self) -> int:
        return sum(t.numel() for _, t in self.created.values())

    def send_segment(self, peer: int, nbytes: int, key: str) -> torch.Tensor:
        """This rank's send slots to ``peer`` (made now unless the same sizes were made before)."""
        path = self._path(self.same_host.rank, peer, nbytes, key)
        have = self.created.get(peer)
        if have is not None and have[0] == path:
            return have[1]
        self.release(peer)
        sweep_stale(self.directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        mapping = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.created[peer] = (path, mapping)
        return mapping

    def recv_segment(self, peer: int, nbytes: int, key: str) -> torch.Tensor:
        """``peer``'s send slots to this rank: opened (and unlinked) after the peer's first signal."""
        path = self._path(peer, self.same_host.rank, nbytes, key)
        have = self.opened.get(peer)
        if have is not None and have[0] == path:
            return have[1]
        size = os.stat(path).st_size
        if size != nbytes:
            raise RuntimeError(f"shared segment {path} has {size} bytes, the schedule expects {nbytes}")
        mapping = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        _unlink(path)
        self.opened[peer] = (path, mapping)
        return mapping

    def release(self, peer: int) -> None:
        have = self.created.pop(peer, None)
        if have is not None:
            _unlink(have[0])

    def close(self) -> None:
        """Unlink every segment this rank created (its peers' mappings stay valid until they drop them)."""
        for peer in list(self.created):
            self.release(peer)
        self.opened.clear()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


SIGNAL_ONLY = torch.empty(0, dtype=torch.uint8)  # the buffer of a receive whose bytes are in a shared slot


class SharedSegments:
    """The shared segments of one transfer: made (send) at schedule time, opened (recv) at first use, after
    the peer's first signal."""

    def __init__(self, slots: SharedSlots, schedule: Schedule, key: Callable[[int], str]) -> None:
        self.slots = slots
        self.schedule = schedule
        self.key = key
        self.found: dict[tuple[str, int], torch.Tensor] = {}  # looked up once per transfer, not per message

    def of(self, direction: str, peer: int) -> torch.Tensor:
        found = self.found.get((direction, peer))
        if found is not None:
            return found
        nbytes = self.schedule.shared_bytes[(direction, peer)]
        if direction == "send":
            found = self.slots.send_segment(peer, nbytes, self.key(peer))
        else:
            found = self.slots.recv_segment(peer, nbytes, self.key(peer))
        self.found[(direction, peer)] = found
        return found
