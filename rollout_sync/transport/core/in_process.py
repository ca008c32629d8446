"""Handoffs between two ranks of one sync group that live in the same process.

A trainer process that also holds a vLLM worker (TRL's colocate mode) is two ranks of the group, each run by
its own thread. Their segments never touch the process group: the sender ``offer``s its source storages in a
process-wide mailbox, the receiver ``take``s them and copies each segment straight from them into its
targets (``handoff.copy_handoff``: one copy; ``copy_`` also crosses devices), then ``finish``es the offer,
which releases the sender's wait. A receiver that fails before taking an offer ``decline``s it.

Every wait is bounded like a wire wait (``timedelta`` in, a raised ``RuntimeError`` naming a timeout out,
which ``p2p.Transport`` turns into ``SyncTimeoutError``). A rank that leaves its group
(``InProcess.leave``) fails every offer or take a peer in this process still waits for at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

__all__ = ["HANDOFF_TAG", "InProcess", "MailboxWork"]

HANDOFF_TAG = -1
"""The mailbox tag of a pair's handoff (message tags are non-negative)."""

_lock = threading.Lock()
# (group id, source rank, destination rank, tag) -> posts not yet matched, oldest first
_boxes: dict[tuple[str, int, int, int], deque[_Post]] = {}
_left: dict[tuple[str, int], str] = {}  # (group id, rank) -> why that rank left its group


@dataclass(eq=False)
class _Post:
    kind: str  # "send" (an offer) or "recv" (a take waiting for one)
    tensor: Any  # an offer's source storages
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    offer: _Post | None = None  # a waiting take: the offer that matched it


class MailboxWork:
    """The work of one offer or take (the shape of a process group's work: ``wait``)."""

    def __init__(self, post: _Post) -> None:
        self.post = post

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self.post.done.wait(seconds):
            raise RuntimeError(f"in-process message timed out after {seconds:g} s")
        if self.post.error is not None:
            raise RuntimeError(self.post.error)
        return True


class InProcess:
    """The in-process side of one rank's transport: ``peers`` are the ranks of group ``group_id`` that run
    in this process (each on its own thread)."""

    def __init__(self, group_id: str, rank: int, peers: frozenset[int]) -> None:
        self.group_id = group_id
        self.rank = rank
        self.peers = peers
        self._taken: dict[int, _Post] = {}  # peer -> its offer this rank took and has not finished

    def offer(self, peer: int, sources: Mapping[str, torch.Tensor]) -> MailboxWork:
        """Offer this rank's source storages to ``peer``; the work is done when the peer ``finish``es."""
        mine = _Post("send", sources)
        with _lock:
            gone = _left.get((self.group_id, peer))
            if gone is not None:
                mine.error = gone
                mine.done.set()
                return MailboxWork(mine)
            key = (self.group_id, self.rank, peer, HANDOFF_TAG)
            queue = _boxes.setdefault(key, deque())
            if queue and queue[0].kind == "recv":
                waiting = queue.popleft()
                if not queue:
                    del _boxes[key]
                if waiting.error is not None:  # declined before it came
                    mine.error = waiting.error
                    mine.done.set()
                else:
                    waiting.offer = mine
                    waiting.done.set()
            else:
                queue.append(mine)
        return MailboxWork(mine)

    def decline(self, peer: int, reason: str) -> None:
        """This rank will not take ``peer``'s offer (its sync failed first): the offer, made or still to
        come, fails with ``reason`` at once instead of waiting for the timeout."""
        key = (self.group_id, peer, self.rank, HANDOFF_TAG)
        with _lock:
            queue = _boxes.setdefault(key, deque())
            if queue and queue[0].kind == "send":
                offer = queue.popleft()
                if not queue:
                    del _boxes[key]
            else:
                queue.append(_Post("recv", None, error=reason))
                return
        offer.error = reason
        offer.done.set()

    def take(self, peer: int, timeout: timedelta) -> Mapping[str, torch.Tensor]:
        """The source storages ``peer`` offers this rank (waits for the offer at most ``timeout``). Every
        ``take`` must be followed by ``finish(peer, ...)``, also when copying fails."""
        key = (self.group_id, peer, self.rank, HANDOFF_TAG)
        with _lock:
            gone = _left.get((self.group_id, peer))
            if gone is not None:
                raise RuntimeError(gone)
            queue = _boxes.setdefault(key, deque())
            if queue and queue[0].kind == "send":
                offer = queue.popleft()
                if not queue:
                    del _boxes[key]
                self._taken[peer] = offer
                return offer.tensor
            mine = _Post("recv", None)
            queue.append(mine)
        try:
            MailboxWork(mine).wait(timeout)
        except RuntimeError:
            with _lock:
                waiting = _boxes.get(key)
                if waiting is not None and mine in waiting:
                    waiting.remove(mine)
                    if not waiting:
                        del _boxes[key]
            raise
        assert mine.offer is not None
        self._taken[peer] = mine.offer
        return mine.offer.tensor

    def finish(self, peer: int, error: str | None = None) -> None:
        """The copies from ``peer``'s taken offer are done (or failed with ``error``): release its sender."""
        offer = self._taken.pop(peer, None)
        if offer is not None:
            offer.error = error
            offer.done.set()

    def leave(self, reason: str) -> None:
        """This rank leaves the group: every unmatched message to or from it fails now, on both ends."""
        with _lock:
            _left[(self.group_id, self.rank)] = f"rank {self.rank} left the sync group: {reason}"
            keys = [k for k in _boxes if k[0] == self.group_id and self.rank in (k[1], k[2])]
            posts = [p for k in keys for p in _boxes.pop(k)]
        for p in posts:
            p.error = f"rank {self.rank} left the sync group: {reason}"
            p.done.set()
