"""Public entry points: the storage maps of a live DeepSpeed engine and this rank's storage views.

    maps, sources = trainer_storage(engine)                 # low-precision parameters
    states = trainer_storages(engine, ("fp32", "exp_avg"))  # several states, facts read once

Every rank may call these alone (no collective). Every rank gets the same maps (they describe all ranks);
``sources`` holds this rank's views keyed by logical name. Call again after anything that replaces
DeepSpeed's buffers (loading a checkpoint, re-initializing the engine); an optimizer step keeps them.

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
from .facts import STATES
from .read_engine import read_engine
from .storage_maps import state_maps
from .views import storage_views

__all__ = ["TrainerStorage", "trainer_storage", "trainer_storages"]


class TrainerStorage(NamedTuple):
    """The maps of one state (every logical tensor, every rank) and this rank's views of it."""

    maps: list[TensorMap]
    sources: dict[str, torch.Tensor]


def trainer_storages(engine: Any, states: Sequence[str] = ("param",)) -> dict[str, TrainerStorage]:
    """Maps and views of ``engine`` for each of ``states`` (``param``, ``fp32``, ``exp_avg``,
    ``exp_avg_sq``). Raises a ``LayoutError`` subclass, before anything moves, for a layout the maps do not
    describe (see ``rollout_sync.trainer.refusals``)."""
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
