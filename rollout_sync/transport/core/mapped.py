"""Handoffs between processes on one host: the receiver maps the sender's source storages (CPU memory
files; CUDA allocations through IPC handles, ``cuda_ipc``).

A same-host pair whose receiver can map the sender's memory (found by the probe, ``pulls.probe_pulls``)
has no messages at all: like a pair in one process (``in_process``), its segments are handoffs. The sender
moves each source storage it sends from into shared memory **in place** (``torch.UntypedStorage
._share_fd_cpu_``: a memory file, the storage's data pointer swapped, every view of it, DeepSpeed's
included, keeps working), once per storage; then, at each sync, it sends the receiver a table of those
storages (file descriptor number, inode, bytes, the tensor's offset in it) and waits for "done". The
receiver opens each file through ``/proc/<pid>/fd`` (the kernel allows it where it allows
``process_vm_readv``: same user, ptrace permitted), maps it once (cached by inode for the next syncs), copies
every segment straight from it into its target storage (one cast-copy per element, at memory-copy speed,
any strides) and sends "done" (or "failed").

Why this and not pulls alone: ``process_vm_readv`` pins the sender's pages at every call and reached 3-4
GB/s here against 4-6 GB/s for a copy from a mapping, and rows shorter than 64 KB pulled at half that, so
they were packed by the sender and unpacked by the receiver (two copies, both processes busy). A mapping
copies every segment once, by the receiver alone.

Lifetime: the memory file has no name (unlinked at creation), so nothing is ever left in ``/dev/shm``; it
lives while the sender's storage or a receiver's mapping of it does. A receiver drops the mappings of a
sender's storages that are no longer in its table, and all of them when its executor closes. A sender whose
storage cannot be shared (not on the CPU, or shared memory is full) sends an error row and fails the sync
before the receiver writes any byte of that pair.

CUDA storages (a gloo group whose ranks keep their storages on the GPUs of one host, such as a trainer and
a vLLM engine colocated on one GPU, where NCCL cannot put two ranks): a table row carries the IPC handle of
the caching-allocator block behind the storage and the storage's offset in it. The receiver opens each
block once (cached by handle, closed when a later table no longer names it and when its executor closes;
the driver releases every handle of a process that dies), copies device to device on its current stream,
and synchronizes that stream before it answers "done"; the sender synchronizes its stream before it sends
the table, so the receiver reads finished values. Not yet run on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from . import cuda_ipc

__all__ = [
    "MAP_DONE_TAG",
    "MAP_TABLE_TAG",
    "ROW",
    "MappedPeers",
    "MappedStorages",
    "OfferWork",
    "empty_table",
    "row_of",
    "share",
    "table_of",
    "views_of",
]

MAP_TABLE_TAG = (1 << 30) + 4
"""Tag of a mapped handoff's table (sender to receiver): above every message tag, after the pull probe's
and pulls' tags (``pulls.PROBE_TAG`` + 0..3)."""
MAP_DONE_TAG = MAP_TABLE_TAG + 1
"""Tag of its answer: 0 done, 1 failed (receiver to sender)."""

MEMORY_FILE, CUDA_IPC, UNSHARED = 0, 1, -1
"""Kinds of table row: a CPU storage's memory file, a CUDA storage's IPC handle, a storage not shared."""
ROW = 5 + cuda_ipc.HANDLE_WORDS
"""A row: ``[kind, a, b, storage bytes, the tensor's element offset in its storage, handle words...]``; for
a memory file ``a, b`` are its descriptor number and inode, for a CUDA IPC handle the sender's device index
and the storage's byte offset in the allocation the handle names."""


def share(tensor: torch.Tensor) -> tuple[int, int, int]:
    """Move ``tensor``'s storage (CPU) into shared memory in place (once; a no-op after) and return its file
    descriptor, the file's inode and the storage's bytes. Raises ``RuntimeError`` where it cannot be
    shared."""
    if tensor.device.type != "cpu":
        raise RuntimeError(f"a {tensor.device.type} storage cannot be mapped by another process here")
    storage = tensor.untyped_storage()
    fd, nbytes = storage._share_fd_cpu_()  # type: ignore[attr-defined]
    return int(fd), os.fstat(fd).st_ino, int(nbytes)


def row_of(tensor: torch.Tensor) -> list[int]:
    """The table row of ``tensor``'s storage, shared now: its memory file on CPU (``share``), its
    allocation's IPC handle on CUDA (``cuda_ipc.export``). Raises ``RuntimeError`` where it cannot be
    shared."""
    if tensor.device.type == "cuda":
        words, offset, nbytes = cuda_ipc.export(tensor)
        index = tensor.device.index or 0
        return [CUDA_IPC, index, offset, nbytes, int(tensor.storage_offset()), *words]
    fd, inode, nbytes = share(tensor)
    return [MEMORY_FILE, fd, inode, nbytes, int(tensor.storage_offset()), *([0] * cuda_ipc.HANDLE_WORDS)]


def table_of(names: Sequence[str], sources: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, str | None]:
    """The table a sender sends (a ``row_of`` per name), sharing each storage; and the first storage that
    could not be shared, with why (its row's kind is ``UNSHARED``), or None."""
    rows = torch.zeros((len(names), ROW), dtype=torch.int64)
    rows[:, 0] = UNSHARED
    error = None
    for i, name in enumerate(names):
        try:
            rows[i] = torch.tensor(row_of(sources[name]), dtype=torch.int64)
        except RuntimeError as e:
            error = error or f"source storage {name!r} cannot be shared with a same-host peer: {e}"
    return rows, error


def empty_table(names: Sequence[str]) -> torch.Tensor:
    """A receive buffer for the table of ``names``."""
    return torch.zeros((len(names), ROW), dtype=torch.int64)


class MappedStorages:
    """A receiver's mappings of its same-host senders' storages, kept across syncs: memory files by (pid,
    inode), CUDA allocations by (pid, handle). ``device``: where this rank's storages are (a peer's CUDA
    allocation is opened there)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._maps: dict[tuple[int, int], torch.UntypedStorage] = {}
        self._opened: dict[tuple[int, tuple[int, ...]], int] = {}  # (pid, handle) -> base address here

    def __len__(self) -> int:
        return len(self._maps) + len(self._opened)

    def storage(self, pid: int, row: Sequence[int]) -> torch.UntypedStorage:
        """The sender's storage named by its table ``row`` (mapped or opened now, or kept from an earlier
        sync). Raises ``OSError`` when it cannot be opened or is not the one the sender named."""
        kind, a, b, nbytes = row[:4]
        if kind == CUDA_IPC:
            return self._cuda(pid, a, b, nbytes, tuple(row[5:]))
        if kind != MEMORY_FILE:
            raise OSError(f"the sender could not share the storage (row kind {kind})")
        return self._file(pid, a, b, nbytes)

    def _file(self, pid: int, fd: int, inode: int, nbytes: int) -> torch.UntypedStorage:
        key = (pid, inode)
        found = self._maps.get(key)
        if found is not None and found.nbytes() >= nbytes:
            return found
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            st = os.fstat(local)
            if st.st_ino != inode or st.st_size < nbytes:
                raise OSError(
                    f"descriptor {fd} of pid {pid} is inode {st.st_ino} of {st.st_size} bytes, not inode "
                    f"{inode} of at least {nbytes}"
                )
            mapped = torch.UntypedStorage._new_shared_fd_cpu(local, nbytes)  # type: ignore[attr-defined]
        finally:
            os.close(local)
        self._maps[key] = mapped
        return mapped

    def _cuda(
        self, pid: int, index: int, offset: int, nbytes: int, handle: tuple[int, ...]
    ) -> torch.UntypedStorage:
        if self.device.type != "cuda":
            raise OSError(f"rank storages on {self.device} cannot open the CUDA storage of pid {pid}")
        key = (pid, handle)
        base = self._opened.get(key)
        if base is None:
            try:
                base = self._opened[key] = cuda_ipc.open_handle(handle, self.device)
            except RuntimeError as e:
                raise OSError(
                    f"opening the CUDA allocation of pid {pid} (its device {index}) failed: {e}"
                ) from e
        return cuda_ipc.storage_at(base + offset, nbytes, self.device)

    def keep_only(self, pid: int, rows: Sequence[Sequence[int]]) -> None:
        """Drop the mappings of ``pid``'s storages not named in ``rows`` (its table of this sync)."""
        inodes = {r[2] for r in rows if r[0] == MEMORY_FILE}
        handles = {tuple(r[5:]) for r in rows if r[0] == CUDA_IPC}
        for key in [k for k in self._maps if k[0] == pid and k[1] not in inodes]:
            del self._maps[key]
        for ckey in [k for k in self._opened if k[0] == pid and k[1] not in handles]:
            cuda_ipc.close(self._opened.pop(ckey), self.device)

    def clear(self, strict: bool = True) -> None:
        """Drop every mapping (a CUDA allocation once this rank's copies from it have finished). Not
        ``strict`` (after a failed sync, where a peer may be dead): a CUDA allocation that cannot be closed
        cleanly is let go of without raising; the driver releases it with this process at the latest."""
        self._maps.clear()
        if not self._opened:
            return
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            if strict:
                raise
        for ckey in list(self._opened):
            try:
                cuda_ipc.close(self._opened.pop(ckey), self.device)
            except RuntimeError:
                if strict:
                    raise


@dataclass(eq=False)
class MappedPeers:
    """This rank's mapped pairs: the peers whose storages it maps (``maps_from``: what it receives from them
    is a handoff) and those that map its storages (``mapped_by``: what it sends them), the pid of every
    same-host peer, and its mappings of their storages."""

    pids: Mapping[int, int]
    maps_from: frozenset[int] = frozenset()
    mapped_by: frozenset[int] = frozenset()
    maps: MappedStorages = field(default_factory=MappedStorages)
    tables: dict[int, tuple[tuple[str, ...], torch.Tensor]] = field(default_factory=dict)
    """Per peer this rank maps, the names and table of its last handoff (``Transport.take``)."""


def views_of(
    table: torch.Tensor,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    pid: int,
    maps: MappedStorages,
) -> dict[str, torch.Tensor]:
    """The sender's source tensors named in ``table``: a tensor of each name's dtype at its offset in the
    mapped storage (``torch.as_strided`` of a segment is then checked against the storage's size)."""
    out = {}
    rows = table.tolist()
    for name, dtype, row in zip(names, dtypes, rows, strict=True):
        if row[0] == UNSHARED:
            raise OSError(f"the sender could not share source storage {name!r}")
        storage = maps.storage(pid, row)
        out[name] = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, row[4], (0,), (1,))
    maps.keep_only(pid, rows)
    return out


class OfferWork:
    """A sender's wait for a mapped handoff's answer (the shape of a group's work: ``wait``): raises when
    the receiver says it failed."""

    def __init__(self, work: Any, answer: torch.Tensor, peer: int, sent: Any, table: torch.Tensor) -> None:
        self.work = work
        self.answer = answer
        self.peer = peer
        self.sent = sent  # the table's send, and the table: alive until it has left
        self.table = table

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.sent.wait(timeout)
        self.work.wait(timeout)
        if int(self.answer[0]) != 0:
            raise RuntimeError(f"rank {self.peer} failed copying from this rank's mapped storages")
        return True
