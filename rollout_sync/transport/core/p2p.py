"""Posting point-to-point messages on a group object and waiting for them within a timeout.

Keyed by backend:

- NCCL: the sends and receives of one batch (every direct message; then each packed round) are issued
  between ``_start_coalescing`` and ``_end_coalescing`` on the group (NCCL group start/end), so they
  progress together; one work covers the batch. NCCL matches a pair's messages in issue order (tags are
  ignored); both ends issue them in schedule order. Not yet run on a GPU.
- every other backend (gloo, ...): each message is posted on its own with ``group.send`` /
  ``group.recv`` (many tagged messages may be outstanding at once) and has its own work.

Every wait is bounded: a peer that dies turns into ``PeerFailedError``, one that stalls into
``SyncTimeoutError``, both naming this rank, the peer and the round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ...errors import PeerFailedError, SyncTimeoutError
from .in_process import InProcess
from .mapped import MAP_DONE_TAG, MAP_TABLE_TAG, MappedPeers, OfferWork, empty_table, table_of, views_of

__all__ = ["Pending", "Transport", "transport_for"]


@dataclass(slots=True)
class Pending:
    """A posted message: ``kind`` is ``"send"`` or ``"recv"``."""

    work: Any
    peer: int
    kind: str
    label: str  # "round 3", "direct message 0": for errors
    done: bool = False


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int
    tag: int
    label: str


def _is_timeout(text: str) -> bool:
    lowered = text.lower()
    return "timed out" in lowered or "timeout" in lowered


class Transport:
    """Individually posted messages (gloo and any backend without coalescing). Messages to a peer in this
    process (``local``) or to a same-host peer that maps this rank's storages or whose storages this rank maps
    (``mapped``) do not exist: their segments are handoffs (``offer`` / ``take``)."""

    def __init__(
        self,
        group: Any,
        rank: int,
        timeout: float,
        device: torch.device,
        local: InProcess | None = None,
        shared: frozenset[int] = frozenset(),
        mapped: MappedPeers | None = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.device = device
        self.local = local
        self.shared = shared  # peers whose message bytes sit in shared slots: only signals cross the group
        self.mapped = mapped
        self.kept: list[Pending] = []  # answers of declined handoffs, alive until their sends complete
        # mapped peers whose storages this rank copied from as last named, and this sync's table still coming
        self._unconfirmed: dict[
            int, tuple[Pending, torch.Tensor, torch.Tensor, tuple[str, ...], tuple[Any, ...]]
        ]
        self._unconfirmed = {}

    def _maps(self, peer: int, sending: bool) -> MappedPeers | None:
        """The mapped pairs, where this rank's handoff with ``peer`` in this direction is mapped."""
        m = self.mapped
        if m is None or peer not in (m.mapped_by if sending else m.maps_from):
            return None
        return m

    def signal(
        self, kind: str, peer: int, tag: int, label: str, tensor: torch.Tensor | None = None
    ) -> Pending:
        """A small message over the group (8 bytes unless ``tensor`` is given): "tag packed", "tag unpacked,
        its slot is free" (tag + 1), a pull's address table, "pulled"."""
        return self._post_one(
            Op(kind, torch.zeros(1, dtype=torch.int64) if tensor is None else tensor, peer, tag, label)
        )

    def _post_one(self, op: Op) -> Pending:
        """``op`` on the group as it is (its own work)."""
        try:
            if op.kind == "send":
                work = self.group.send([op.tensor], op.peer, op.tag)
            else:
                work = self.group.recv([op.tensor], op.peer, op.tag)
        except RuntimeError as e:
            raise self._error(op.kind, op.peer, op.label, str(e)) from e
        return Pending(work, op.peer, op.kind, op.label)

    def consumed(self, peer: int, tag: int, label: str) -> Pending | None:
        """This rank unpacked message ``tag`` from a shared slot of ``peer``: tell the peer the slot is free."""
        if peer not in self.shared:
            return None
        return self.signal("send", peer, tag + 1, label)

    def offer(self, peer: int, sources: Mapping[str, torch.Tensor], names: Sequence[str] = ()) -> Pending:
        """Hand this rank's source storages to ``peer`` (``schedule.handoff_to``): in this process, or, for a
        mapped peer, as the table of ``names`` (the storages its segments read, sorted), shared now."""
        if self._maps(peer, sending=True) is None:
            assert self.local is not None
            return Pending(self.local.offer(peer, sources), peer, "send", "handoff")
        table, error = table_of(names, sources)
        if self.device.type == "cuda":  # the peer reads the sources on its own stream: finish writing them
            torch.cuda.current_stream(self.device).synchronize()
        sent = self.signal("send", peer, MAP_TABLE_TAG, "mapped handoff table", table)
        answer = torch.ones(1, dtype=torch.int64)
        done = self.signal("recv", peer, MAP_DONE_TAG, "mapped handoff", answer)
        if error is not None:  # the peer reads the -1 row and fails too, before writing a byte of this pair
            self.kept.append(sent)
            raise PeerFailedError(f"rank {self.rank}: {error}")
        return Pending(OfferWork(done.work, answer, peer, sent.work, table), peer, "send", "mapped handoff")

    def take(
        self,
        peer: int,
        names: Sequence[str] = (),
        dtypes: Sequence[torch.dtype] = (),
        provisional: bool = False,
    ) -> Mapping[str, torch.Tensor]:
        """The source storages ``peer`` hands this rank (in this process, or mapped from its memory: the
        tensors of ``names``, of ``dtypes``); follow with ``confirm`` and ``finish``. ``provisional``: a
        mapped peer's storages as its table of the last sync named them, without waiting for this sync's
        (the agreement already told that the peer is in this sync, its sources ready); ``confirm`` then
        says whether they are still the ones it hands over."""
        maps = self._maps(peer, sending=False)
        if maps is None:
            assert self.local is not None
            try:
                return self.local.take(peer, timedelta(seconds=self.timeout))
            except RuntimeError as e:
                raise self._error("recv", peer, "handoff", str(e)) from e
        table = empty_table(names)
        pending = self.signal("recv", peer, MAP_TABLE_TAG, "mapped handoff table", table)
        last = maps.tables.get(peer)
        # provisional only on CPU: a CUDA sender's stream may still be writing its sources at the
        # agreement; its table leaves after it synchronized
        provisional = provisional and self.device.type == "cpu"
        if provisional and last is not None and last[0] == tuple(names):
            self._unconfirmed[peer] = (pending, table, last[1], tuple(names), tuple(dtypes))
            return self._views(peer, maps, last[1], names, dtypes)
        self.wait([pending])
        maps.tables[peer] = (tuple(names), table)
        return self._views(peer, maps, table, names, dtypes)

    def confirm(self, peer: int) -> Mapping[str, torch.Tensor] | None:
        """After copying from provisional storages: None where they were the ones ``peer`` hands over in
        this sync, else the storages it does hand over (copy again from them)."""
        found = self._unconfirmed.pop(peer, None)
        if found is None:
            return None
        pending, table, used, names, dtypes = found
        self.wait([pending])
        maps = self._maps(peer, sending=False)
        assert maps is not None
        maps.tables[peer] = (names, table)
        return None if torch.equal(table, used) else self._views(peer, maps, table, names, dtypes)

    def _views(
        self,
        peer: int,
        maps: MappedPeers,
        table: torch.Tensor,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
    ) -> Mapping[str, torch.Tensor]:
        try:
            return views_of(table, names, dtypes, maps.pids[peer], maps.maps)
        except (OSError, RuntimeError) as e:
            self.kept += [p for p in [self.finish(peer, str(e))] if p is not None]
            raise PeerFailedError(
                f"rank {self.rank}: mapping the storages of rank {peer} (pid {maps.pids[peer]}) failed: {e}"
            ) from e

    def finish(self, peer: int, error: str | None = None) -> Pending | None:
        """The copies from ``peer``'s handoff are done (or failed with ``error``): release its sender."""
        if self._maps(peer, sending=False) is None:
            assert self.local is not None
            self.local.finish(peer, error)
            return None
        if error is None and self.device.type == "cuda":  # the copies from its storages are queued: finish
            try:
                torch.cuda.current_stream(self.device).synchronize()
            except RuntimeError:
                failed = torch.ones(1, dtype=torch.int64)
                self.kept.append(self.signal("send", peer, MAP_DONE_TAG, "mapped handoff failed", failed))
                raise
        answer = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        return self.signal("send", peer, MAP_DONE_TAG, "mapped handoff done", answer)

    def decline(self, peer: int, reason: str) -> None:
        """This rank failed before taking ``peer``'s handoff: fail the peer's offer now."""
        if self._maps(peer, sending=False) is None:
            assert self.local is not None
            self.local.decline(peer, reason)
            return
        answer = torch.ones(1, dtype=torch.int64)
        self.kept.append(self.signal("send", peer, MAP_DONE_TAG, "mapped handoff declined", answer))

    def post(self, ops: Sequence[Op]) -> list[Pending]:
        pending = []
        for op in ops:
            if op.peer in self.shared:  # the bytes are in the shared slot already (send) or will be (recv)
                pending.append(self.signal(op.kind, op.peer, op.tag, op.label))
                if op.kind == "send":  # done only when the peer has unpacked it: the slot is free again
                    pending.append(self.signal("recv", op.peer, op.tag + 1, op.label + " (slot freed)"))
                continue
            pending.append(self._post_one(op))
        return pending

    def completed(self, p: Pending) -> bool:
        """Whether ``p`` has finished, without waiting (a failure is raised by the next ``wait``)."""
        if not p.done:
            try:
                p.done = bool(p.work.is_completed()) and p.work.is_success()
            except RuntimeError:
                return False
        return p.done

    def wait(self, pending: Sequence[Pending]) -> None:
        for p in pending:
            if p.done:
                continue
            try:
                finished = p.work.wait(timedelta(seconds=self.timeout))
            except RuntimeError as e:
                raise self._error(p.kind, p.peer, p.label, str(e)) from e
            if finished is False:
                raise self._error(p.kind, p.peer, p.label, "the wait returned unfinished")
            p.done = True

    def _error(self, kind: str, peer: int, label: str, text: str) -> Exception:
        what = "sending to" if kind == "send" else "receiving from"
        if _is_timeout(text):
            return SyncTimeoutError(
                f"rank {self.rank}: {what} rank {peer} ({label}) made no progress within "
                f"{self.timeout:g} s; the peer stalled or died: {text}"
            )
        return PeerFailedError(f"rank {self.rank}: {what} rank {peer} ({label}) failed: {text}")


class CoalescedTransport(Transport):
    """NCCL: one group start/end per posted batch (a round); all its messages share one work."""

    def post(self, ops: Sequence[Op]) -> list[Pending]:
        if not ops:
            return []
        # A ProcessGroup (torch.distributed's WORLD) takes the device; a backend object built directly
        # (ProcessGroupNCCL over a store) takes none.
        args = (self.device,) if isinstance(self.group, ProcessGroup) else ()
        try:
            self.group._start_coalescing(*args)
            for op in ops:
                if op.kind == "send":
                    self.group.send([op.tensor], op.peer, op.tag)
                else:
                    self.group.recv([op.tensor], op.peer, op.tag)
            work = self.group._end_coalescing(*args)
        except RuntimeError as e:
            peers = sorted({op.peer for op in ops})
            raise PeerFailedError(
                f"rank {self.rank}: posting {ops[0].label} with ranks {peers} failed: {e}"
            ) from e
        return [Pending(work, op.peer, op.kind, op.label) for op in ops]


def transport_for(
    group: Any,
    backend: str,
    rank: int,
    timeout: float,
    device: torch.device,
    local: InProcess | None = None,
    shared: frozenset[int] = frozenset(),
    mapped: MappedPeers | None = None,
) -> Transport:
    if backend == "nccl":
        return CoalescedTransport(group, rank, timeout, device, local)
    return Transport(group, rank, timeout, device, local, shared, mapped)
