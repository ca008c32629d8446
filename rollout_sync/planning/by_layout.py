"""The whole plan, planned once per layout: ``plan_model`` for models of millions of segments.

A model's layers repeat a handful of layouts (a Kimi-K2-class model has 70,000 logical tensors and about
1,200 distinct layouts). A tensor's segments depend only on its layout (shape, source regions, target
regions) when no replica choice can depend on its name: under the ``lowest`` policy, or when every source
region has a single holder (ZeRO-3 partitions, expert shards). Such tensors share one record array per
layout; the others (replicas under a local policy such as ``policy.Spread``, whose choice depends on the
tensor's name) are planned one by one. Every record array comes from ``plan_model`` itself, called once on
one representative pair per shared layout and on every other pair, so the result equals
``plan_model(sources, targets, policy)`` record for record (the tests check it); only the time differs
(the planner plans each tensor with a callable policy anew).

Layouts are recognised by the identity of the maps' regions objects: maps built from the same storage
objects share them (``TensorMap``), as the whole-model builders (``rollout_sync.geometry.model_maps``) arrange.
Maps with equal but separately built regions are planned separately, which is only slower.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from ..errors import PlanMismatchError
from ..layout.maps import TensorMap
from .map_pairs import LayoutKey, SharedLayouts, matched_pairs, planned_tensor
from .plan import Plan
from .planner import plan_model
from .policy import ReplicaPolicy
from .rank_half import require_local
from .records import PlannedTensor

__all__ = ["plan_model_by_layout"]


def plan_model_by_layout(
    sources: Sequence[TensorMap], targets: Sequence[TensorMap], policy: ReplicaPolicy = "lowest"
) -> Plan:
    """``plan_model(sources, targets, policy)``, computing each shared layout once. ``policy`` must be
    local (``"lowest"`` or e.g. ``policy.Spread()``; see ``rank_half.require_local``): a greedy policy's
    choices depend on the order of the whole plan and are refused."""
    policy = require_local(policy)
    pairs = matched_pairs(sources, targets)
    layouts = SharedLayouts(every_pair=policy == "lowest")
    shared: dict[LayoutKey, int] = {}  # layout -> representative index
    reps: list[tuple[TensorMap, TensorMap]] = []
    owner: list[int] = []
    for s, t in pairs:
        key = layouts.key(s, t)
        if key is not None:
            index = shared.get(key)
            if index is None:
                index = shared[key] = len(reps)
                reps.append((s, t))
            owner.append(index)
        else:
            owner.append(len(reps))
            reps.append((s, t))
    planned = plan_model([p[0] for p in reps], [p[1] for p in reps], policy)
    for (_, t), pt in zip(reps, planned.tensors, strict=True):
        if pt.name != t.name:  # both lists are in name order; a planner that reorders would break this
            raise PlanMismatchError(f"planner returned tensor {pt.name!r} where {t.name!r} was expected")
    tensors: list[PlannedTensor] = [planned_tensor(s, t) for s, t in pairs]
    records: list[array] = [planned.records(index) for index in owner]
    return Plan.from_records(tensors, records, validate=False)
