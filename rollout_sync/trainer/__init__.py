"""Trainer side: storage maps of a live DeepSpeed engine (ZeRO-0/1/2/3, AutoTP, AutoEP) and storage views
of its own buffers.

Pure modules (no torch): ``facts`` (layout facts), ``placement`` (TP/EP placements from DeepSpeed's
descriptions), ``naming`` (logical tensor names), ``zero_geometry`` (ZeRO-1/2 flat buffers),
``storage_maps`` (facts to maps), ``dry_run`` (facts from a model config and a layout description),
``refusals``. Live modules: ``read_engine`` (facts and buffers of an
engine), ``views``, ``storage`` (entry points). The live modules import torch; DeepSpeed is imported only
when an engine is read.
"""

from .dry_run import dry_run_facts
from .facts import STATES, LogicalPart, ParamFacts, TrainerFacts, ZeroGroup
from .storage_maps import LocalRun, StorageMap, state_maps

__all__ = [
    "STATES",
    "LocalRun",
    "LogicalPart",
    "ParamFacts",
    "StorageMap",
    "TrainerFacts",
    "TrainerStorage",
    "ZeroGroup",
    "dry_run_facts",
    "state_maps",
    "trainer_storage",
    "trainer_storages",
    "watched_storage",
]


def __getattr__(name: str) -> object:
    # The live entry points import torch; keep ``import rollout_sync.trainer`` pure.
    if name in ("TrainerStorage", "trainer_storage", "trainer_storages", "watched_storage"):
        from . import storage

        return getattr(storage, name)
    raise AttributeError(name)
