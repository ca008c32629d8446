"""A rank's target storages during one transfer: given tensors, and streamed ones (given as meta tensors)
that a ``TargetStream`` makes at their first part and closes after their last. A stream may also watch given
targets (``watches``): it is told when the last part of one has landed, so that what it derives from that
target (a kernel's form rebuilt from a kept loaded form) is made while the rest is still on the wire."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from ...planning.half import PlanHalf
from .program import Program

__all__ = ["TargetStream", "Targets"]


class TargetStream(Protocol):
    """Targets that exist only while they are written (given to ``execute`` as meta tensors)."""

    def open(self, name: str) -> torch.Tensor:
        """The storage of target ``name``, made now (at its first received byte)."""
        ...

    def close(self, name: str) -> None:
        """Every element of ``name`` this rank receives has landed."""
        ...

    def watches(self, name: str) -> bool:
        """Whether to ``close`` given (not streamed) target ``name`` too once its last part has landed."""
        ...

    def held_bytes(self) -> int:
        """The memory the stream holds now for targets it made and has not released."""
        ...

    def adds_bytes(self, name: str) -> int:
        """The memory making target ``name`` would add now (0 when what holds it is already made)."""
        ...

    def reserve_bytes(self) -> int:
        """Memory to leave free beside what the stream holds (what closing a target may allocate)."""
        ...

    def room_bytes(self) -> int:
        """Memory the stream needs within the staging cap beside the slots: what it holds with one target
        made, and what closing it may allocate."""
        ...


class Targets:
    """This rank's target storages during one transfer: the given tensors, and the streamed ones (given as
    meta tensors) made by the stream at their first part and closed after their last."""

    def __init__(
        self,
        given: Mapping[str, torch.Tensor],
        stream: TargetStream | None,
        half: PlanHalf,
        program: Program,
    ) -> None:
        self.given = given
        self.stream = stream
        self.streamed: frozenset[str] = frozenset()
        self.watched: frozenset[str] = frozenset()
        self.remaining: dict[str, int] = {}
        self.made: dict[str, torch.Tensor] = {}
        if stream is None:
            return
        self.streamed = frozenset(n for n, t in given.items() if t.is_meta)
        self.watched = frozenset(n for n, t in given.items() if not t.is_meta and stream.watches(n))
        names = [parts[0].name for _, parts in program.direct_receives]
        names += [p.name for entries in program.receives.values() for _, parts in entries for p in parts]
        names += [half.tensors[s.tensor].name for s in program.schedule.local]
        names += [half.tensors[s.tensor].name for _, segs in program.schedule.handoff_from for s in segs]
        for name in names:
            if name in self.streamed or name in self.watched:
                self.remaining[name] = self.remaining.get(name, 0) + 1

    def get(self, name: str) -> torch.Tensor:
        made = self.made.get(name)
        if made is not None:
            return made
        if name not in self.streamed or self.stream is None:
            return self.given[name]
        placeholder = self.given[name]
        storage = self.stream.open(name)
        if storage.shape != placeholder.shape or storage.dtype != placeholder.dtype:
            raise ValueError(
                f"the stream made target {name!r} as {tuple(storage.shape)} {storage.dtype}, expected "
                f"{tuple(placeholder.shape)} {placeholder.dtype}"
            )
        self.made[name] = storage
        return storage

    def held_bytes(self) -> int:
        return 0 if self.stream is None else self.stream.held_bytes()

    def adds_bytes(self, name: str) -> int:
        if name in self.made or self.stream is None:
            return 0
        return self.stream.adds_bytes(name)

    def reserve_bytes(self) -> int:
        return 0 if self.stream is None else self.stream.reserve_bytes()

    def landed(self, name: str) -> None:
        """One part of ``name`` landed; after its last, the stream closes it."""
        left = self.remaining.get(name)
        if left is None or self.stream is None:
            return
        if left > 1:
            self.remaining[name] = left - 1
            return
        del self.remaining[name]
        self.made.pop(name, None)
        self.stream.close(name)
