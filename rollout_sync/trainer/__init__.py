"""The trainer side: DeepSpeed (ZeRO-0/1/2/3, AutoTP, AutoEP) engines described as storage maps, views of
their buffers, and the hook that syncs after each optimizer step.

Pure modules (no torch): ``facts`` (layout facts), ``placement`` (TP/EP placements from DeepSpeed's descriptions),
``naming`` (logical tensor names), ``storage_maps`` (facts to maps), ``shape_facts`` (the facts an engine
would hold, from a model's shape table and a layout description); DeepSpeed's arithmetic (flat buffers, partitions, AutoTP shard sizes) is
``rollout_sync.geometry.deepspeed``. Live modules: ``engine/`` (reading a DeepSpeed engine: its
facts, buffers, placements and refusals; ``engine/read.py`` first); ``views``, ``storage``
(entry points), ``freshness`` and ``fresh_views`` (views kept valid between syncs), ``step_hook`` and
``hook`` (``TrainerSync``). The live modules import torch; DeepSpeed is imported only when an engine is read.
"""

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
