"""Trainer storage maps from layout facts (pure: no torch, no DeepSpeed).

For one state (``param``, ``fp32``, ``exp_avg``, ``exp_avg_sq``) every parameter's placement shards get
their ZeRO storage (``shard_storages``), each logical part of the parameter is cut out of that placement
(``part_layout``), and ``rollout_sync.layout.nesting.nest`` composes the result into a ``TensorMap`` in
global ranks.

Storage of a placement shard ``S`` (``n`` elements) over its ZeRO group ``ranks``:

- ``param`` under ZeRO-0/1/2: ``S`` whole on every rank of the group (all are holders);
- ``param`` under ZeRO-3, and every optimizer state under ZeRO-3: group rank ``i`` holds elements ``[i·p,
  min((i+1)·p, n))`` of ``S``'s flattening, ``p = ceil(n / len(ranks))`` (DeepSpeed's ``ds_tensor``; the
  padding of the last partitions is excluded, an all-padding partition is an empty storage);
- optimizer states under ZeRO-1/2: ``S`` is the run ``[o, o + n)`` of a flat buffer of ``N`` elements
  (``ZeroGroup.flat_offset``/``flat_numel``) that the group partitions evenly; group rank ``i`` holds
  ``[max(o, i·P), min(o + n, (i+1)·P))``, ``P = N / len(ranks)`` (possibly empty).

Storage of a logical part: the part must be one dense block of each shard that holds any of it (the whole
shard, or one expert's slab of a packed expert shard). A rank's storage is then the part's elements in that
rank's storage of the shard: the sub-block itself (N-D, its logical shape) where the shard is stored
whole, or the intersection of the rank's run with the block's flat range (1-D) where it is stored as runs.
``LocalRun`` says where that storage sits in the shard's flattening, so that the rank holding it can take
the view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import pairwise
from math import prod

from ..errors import LayoutError, NotAffineError, UnsupportedLayoutError
from ..geometry.deepspeed import zero3_runs
from ..layout.box import row_major_strides
from ..layout.maps import TensorMap
from ..layout.nesting import nest
from ..layout.runs import flat_run_boxes
from ..layout.shards import FlatRun, FlatRuns, Layout, Shard, ShardBlock, ShardStorage, Whole
from .facts import STATES, LogicalPart, ParamFacts, TrainerFacts, ZeroGroup

__all__ = ["LocalRun", "StorageMap", "part_layout", "shard_storages", "state_maps"]


@dataclass(frozen=True, slots=True)
class LocalRun:
    """Where one rank's storage of a logical tensor sits: elements ``[start, stop)`` of the flattening of
    placement shard ``shard`` of parameter ``param``, viewed with ``shape`` (empty when start == stop)."""

    param: str
    shard: int
    start: int
    stop: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StorageMap:
    """A map and, for every rank in it, where that rank's storage sits (``LocalRun``)."""

    map: TensorMap
    local: Mapping[int, LocalRun]


def zero12_runs(group: ZeroGroup, numel: int, *, tensor: str) -> FlatRuns:
    """ZeRO-1/2 optimizer-state runs of a shard of ``numel`` elements at ``group.flat_offset`` in a flat
    buffer of ``group.flat_numel`` elements partitioned evenly over ``group.ranks``."""
    if group.flat_offset is None or group.flat_numel is None:
        raise LayoutError(
            "ZeRO-1/2 optimizer states need the shard's position in its flat buffer",
            tensor=tensor,
            expected="flat_offset and flat_numel",
            found=None,
        )
    o, total = group.flat_offset, group.flat_numel
    if o + numel > total:
        raise LayoutError(
            "shard runs past the end of its flat buffer",
            tensor=tensor,
            expected=f"offset + {numel} <= {total}",
            found=o,
        )
    part = total // len(group.ranks)
    runs = []
    for i, rank in enumerate(group.ranks):
        lo = max(o, i * part)
        hi = min(o + numel, (i + 1) * part)
        runs.append(FlatRun(rank, lo - o, hi - o) if lo < hi else FlatRun(rank, 0, 0))
    return FlatRuns(tuple(runs))


def shard_storages(pf: ParamFacts, stage: int, state: str) -> dict[int, ShardStorage]:
    """The storage of each placement shard of ``pf`` for ``state`` under ZeRO ``stage``."""
    if state not in STATES:
        raise LayoutError("unknown state", tensor=pf.name, expected=STATES, found=state)
    out: dict[int, ShardStorage] = {}
    for k, shard in pf.placement.shards.items():
        group = pf.zero[k]
        n = prod(shard.shape)
        if stage == 3:
            out[k] = zero3_runs(group.ranks, n)
        elif state == "param":
            out[k] = Whole(group.ranks)
        elif stage == 0:
            raise UnsupportedLayoutError(
                "optimizer-state maps are described for ZeRO-1/2 and ZeRO-3 only",
                tensor=pf.name,
                expected="ZeRO stage 1, 2 or 3",
                found=f"stage 0, state {state!r}",
            )
        else:
            out[k] = zero12_runs(group, n, tensor=pf.name)
    return out


def _dense(origin: tuple[int, ...], extent: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A box of a row-major ``shape`` is one run of its flattening: every axis after its first axis of
    extent > 1 is whole."""
    d = 0
    while d < len(extent) and extent[d] == 1:
        d += 1
    return all(origin[a] == 0 and extent[a] == shape[a] for a in range(d + 1, len(shape)))


def part_layout(
    pf: ParamFacts, part: LogicalPart, storages: Mapping[int, ShardStorage]
) -> tuple[Layout, dict[int, ShardStorage], dict[int, LocalRun]]:
    """The layout of one logical part (its own shards, in the parameter's placement ranks), the storage of
    each of those shards, and every storing rank's ``LocalRun``."""
    ndim = len(pf.shape)
    drop = part.dropped
    shards: dict[int, Shard] = {}
    out_storage: dict[int, ShardStorage] = {}
    local: dict[int, LocalRun] = {}
    p_end = tuple(o + e for o, e in zip(part.origin, part.extent, strict=True))
    for k, shard in pf.placement.shards.items():
        subs = []  # (shard origin, parameter origin, extent) of each block's part inside the logical part
        for block in shard.blocks:
            s_org, l_org, ext = [], [], []
            for d in range(ndim):
                lo = max(block.logical_origin[d], part.origin[d])
                hi = min(block.logical_origin[d] + block.extent[d], p_end[d])
                if hi <= lo:
                    break
                s_org.append(block.shard_origin[d] + lo - block.logical_origin[d])
                l_org.append(lo)
                ext.append(hi - lo)
            else:
                subs.append((tuple(s_org), tuple(l_org), tuple(ext)))
        if not subs:
            continue
        b_org = tuple(min(s[0][d] for s in subs) for d in range(ndim))
        b_end = tuple(max(s[0][d] + s[2][d] for s in subs) for d in range(ndim))
        b_ext = tuple(e - o for o, e in zip(b_org, b_end, strict=True))
        if sum(prod(s[2]) for s in subs) != prod(b_ext) or not _dense(b_org, b_ext, shard.shape):
            raise NotAffineError(
                "a logical tensor's part of a placement shard is not one dense block of that shard",
                tensor=part.name,
                expected=f"a dense block of shard {shard.shape} (placement rank {k}) of parameter {pf.name!r}",
                found=f"block origin {b_org}, extent {b_ext}",
            )
        strides = row_major_strides(shard.shape)
        base = sum(o * s for o, s in zip(b_org, strides, strict=True))
        n = prod(b_ext)
        sub_shape = b_ext[drop:]
        shards[k] = Shard(
            sub_shape,
            tuple(
                ShardBlock(
                    tuple(a - b for a, b in zip(s_o, b_org, strict=True))[drop:],
                    tuple(a - b for a, b in zip(l_o, part.origin, strict=True))[drop:],
                    ext[drop:],
                )
                for s_o, l_o, ext in subs
            ),
        )
        storage = storages[k]
        if isinstance(storage, Whole):
            out_storage[k] = storage
            for rank in storage.ranks:
                local[rank] = LocalRun(pf.name, k, base, base + n, sub_shape)
        else:
            runs = []
            for run in storage.runs:
                lo, hi = max(run.start, base), min(run.stop, base + n)
                if lo < hi:
                    runs.append(FlatRun(run.rank, lo - base, hi - base))
                    local[run.rank] = LocalRun(pf.name, k, lo, hi, (hi - lo,))
                else:
                    runs.append(FlatRun(run.rank, 0, 0))
                    local[run.rank] = LocalRun(pf.name, k, 0, 0, (0,))
            out_storage[k] = FlatRuns(tuple(runs))
    _align_replica_runs(shards, out_storage)
    return Layout(part.name, part.shape, shards), out_storage, local


def _align_replica_runs(shards: dict[int, Shard], storages: Mapping[int, ShardStorage]) -> None:
    """Cut replicated shards at every run boundary of every replica, in place.

    Placement ranks that hold the same shard (a parameter AutoTP leaves whole) store it as runs that can
    start at different places (ZeRO-1/2 flat offsets differ between TP ranks whose split parameters differ
    in size). A box of one rank's run would then overlap another rank's box of the same elements without
    being the same box. Cutting the shard into blocks at the union of all boundaries (each block one flat
    run of the shard, as ``flat_run_boxes`` cuts it) makes every rank's pieces those blocks, identical
    across replicas, so that their holders are found."""
    groups: dict[Shard, list[int]] = {}
    for k, shard in shards.items():
        if (
            isinstance(storages[k], FlatRuns)
            and len(shard.blocks) == 1
            and shard.blocks[0].extent == shard.shape
        ):
            groups.setdefault(shard, []).append(k)
    for shard, ks in groups.items():
        n = prod(shard.shape)
        bounds = []
        for k in ks:
            storage = storages[k]
            runs = storage.runs if isinstance(storage, FlatRuns) else ()
            bounds.append({0, n, *(x for r in runs if r.stop > r.start for x in (r.start, r.stop))})
        if all(b == bounds[0] for b in bounds):
            continue  # every replica cuts the shard the same way
        cuts = sorted(set().union(*bounds))
        (block,) = shard.blocks
        blocks = []
        for a, b in pairwise(cuts):
            for box in flat_run_boxes(shard.shape, a, b):
                logical = tuple(
                    o - s + g
                    for o, s, g in zip(box.origin, block.shard_origin, block.logical_origin, strict=True)
                )
                blocks.append(ShardBlock(box.origin, logical, box.extent))
        cut = Shard(shard.shape, tuple(blocks))
        for k in ks:
            shards[k] = cut


def state_maps(facts: TrainerFacts, state: str) -> list[StorageMap]:
    """One ``StorageMap`` per logical tensor of the engine, for ``state`` (frozen parameters have maps for
    ``param`` only)."""
    if state == "param":
        dtype = facts.param_dtype
    elif facts.master_dtype is None:
        raise UnsupportedLayoutError(
            "this engine keeps no master weights or optimizer states that a map describes",
            expected="ZeRO stage 1, 2 or 3 with an optimizer",
            found=f"stage {facts.stage}, state {state!r}",
        )
    else:
        dtype = facts.master_dtype
    out: list[StorageMap] = []
    seen: set[str] = set()
    # Parameters with the same geometry (the layers of a model) give the same storages: nest once, reuse.
    cache: dict[object, StorageMap] = {}
    for pf in facts.params:
        if state != "param" and not pf.trainable:
            continue  # a frozen parameter has no master weights or optimizer states
        storages = shard_storages(pf, facts.stage, state)
        geometry = (pf.shape, tuple(sorted(pf.placement.shards.items())), tuple(sorted(storages.items())))
        for part in pf.parts:
            if part.name in seen:
                raise LayoutError(
                    "two parameters claim one logical tensor", tensor=part.name, found=f"again in {pf.name!r}"
                )
            seen.add(part.name)
            key = (geometry, part.shape, part.origin, part.extent)
            hit = cache.get(key)
            if hit is not None:
                out.append(
                    StorageMap(
                        TensorMap(part.name, part.shape, dtype, hit.map.ranks),
                        {r: replace(run, param=pf.name) for r, run in hit.local.items()},
                    )
                )
                continue
            layout, part_storages, local = part_layout(pf, part, storages)
            tmap = nest(layout, part_storages, dtype=dtype)
            sm = StorageMap(tmap, {r: local[r] for r in tmap.ranks})
            cache[key] = sm
            out.append(sm)
    return out
