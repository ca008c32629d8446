"""Public entry points: the storage maps of a live DeepSpeed engine and this rank's storage views.

    maps, sources = trainer_storage(engine)                 # low-precision parameters
    states = trainer_storages(engine, ("fp32", "exp_avg"))  # several states, facts read once

Every rank may call these alone (no collective). Every rank gets the same maps (they describe all ranks);
``sources`` holds this rank's views keyed by logical name. Call again after anything that replaces
DeepSpeed's buffers (re-initializing the engine; ``load_checkpoint`` replaces the Adam states); an optimizer
step keeps them. ``watched_storage`` also returns a watch that tells when that is needed (the trainer hook
checks it before every sync and re-derives the views).

Reading (training to rollout) the ``param`` views gives what the next forward reads. Writing into a training
engine (restoring, resharding) must write ``fp32`` (and the Adam states): on a training engine the
low-precision parameters are derived from the master weights at every step, so a write to ``param`` alone
lasts only until the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..errors import LayoutError
from ..layout.maps import TensorMap
from .engine.read import read_engine
from .facts import STATES
from .freshness import BufferWatch
from .storage_maps import state_maps
from .views import storage_views, watched_views

__all__ = ["TrainerStorage", "trainer_storage", "trainer_storages", "watched_storage"]


class TrainerStorage(NamedTuple):
    """The maps of one state (every logical tensor, every rank) and this rank's views of it."""

    maps: list[TensorMap]
    sources: dict[str, torch.Tensor]


def trainer_storages(engine: Any, states: Sequence[str] = ("param",)) -> dict[str, TrainerStorage]:
    """Maps and views of ``engine`` for each of ``states`` (``param``, ``fp32``, ``exp_avg``,
    ``exp_avg_sq``). Raises a ``LayoutError`` subclass, before anything moves, for a layout the maps do not
    describe (see ``rollout_sync.trainer.engine.refusals``)."""
    for state in states:
        if state not in STATES:
            raise LayoutError("unknown state", expected=STATES, found=state)
    read = read_engine(engine)
    out: dict[str, TrainerStorage] = {}
    for state in states:
        smaps = state_maps(read.facts, state)
        out[state] = TrainerStorage([sm.map for sm in smaps], storage_views(read, smaps, state))
    return out


def trainer_storage(engine: Any, state: str = "param") -> TrainerStorage:
    """Maps and this rank's views of one state of ``engine``."""
    return trainer_storages(engine, (state,))[state]


def watched_storage(
    engine: Any, state: str = "param", *, allow_gathered: bool = False
) -> tuple[TrainerStorage, BufferWatch]:
    """``trainer_storage`` plus a watch that tells, cheaply, when DeepSpeed no longer holds a buffer the
    views were cut from (``rollout_sync.trainer.freshness``). ``allow_gathered``: see ``read_engine``."""
    if state not in STATES:
        raise LayoutError("unknown state", expected=STATES, found=state)
    read = read_engine(engine, allow_gathered=allow_gathered)
    smaps = state_maps(read.facts, state)
    views, watch = watched_views(read, smaps, state)
    return TrainerStorage([sm.map for sm in smaps], views), watch
