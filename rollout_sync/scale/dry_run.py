"""One dry run: every rank's maps from shapes alone, the whole plan, its traffic and time model, a sample
of ranks planning only their own half, and the executor rounds of the busiest ranks.

Steps and what is timed (CPU seconds of this process, ``time.process_time``, so that other jobs on a
shared machine do not inflate them; wall seconds alongside):

1. ``maps_s``: the trainer's source maps (``models.trainer_maps``) and vLLM's target maps
   (``models.vllm_target_maps``), the same builders the live adapters are tested against; global ranks are
   trainer ranks ``0..T-1`` then rollout ranks ``T..T+R-1`` (``models.sides``).
2. ``planner_s``: the whole plan (``planning.by_layout.plan_model_by_layout``, equal to ``plan_model``).
   ``plan_s = maps_s + planner_s``. Map objects are then frozen out of the garbage collector's scans
   (``gc.freeze``): they live as long as the plan.
3. traffic, the wire time of the per-link model and the lower bound (``scale.traffic``).
4. ``rank_half_s``: for a sample of trainer and rollout ranks (first, middle, last and the busiest of each
   side), the best of two runs of ``planning.rank_half.plan_rank_half`` (columnar records); the slowest
   rank is reported. Each sampled half is checked against the whole plan's traffic of that rank.
   ``rank_half_objects_s``: turning the busiest ranks' halves into the executor's ``PlanHalf`` of
   ``Segment`` objects.
5. ``peak_rss_bytes``: the process's peak resident memory after step 4 (``resource.getrusage``).
6. rounds (``scale.rounds``): the executor's schedule of the busiest sender and receiver at the staging cap
   (after the memory figure: this step imports the transport package, hence torch, and builds every
   message of those two ranks). ``modeled_s`` = ``wire_s`` (step 3) + ``overhead_s``: the larger of those
   two ranks' agreement, copies and messages under ``DryRunConfig.links`` (``scale.sync_model``; GPU
   figures assumed, see ``GPU_LINKS``).

Replica policies: ``lowest`` (the lowest holder) and ``balanced`` (``planning.policy.Spread``: balanced and
local, so one rank plans its own half alone). DeepSpeed's stateful greedy ``Balanced`` needs the whole plan
and is not offered here.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from ..geometry.model_maps import trainer_maps, vllm_target_maps
from ..layout.dtypes import ITEMSIZE
from ..layout.maps import TensorMap
from ..planning.by_layout import plan_model_by_layout
from ..planning.policy import ReplicaPolicy, Spread
from ..planning.rank_half import plan_rank_half
from ..shapes.tensors import ModelTensors
from .spec import RolloutLayout, TrainerLayout, check_fit, load_model
from .sync_model import GPU_LINKS, LinkFigures, overhead_seconds
from .traffic import Bandwidth, Topology, lower_bound, modeled_seconds, needed_bytes, plan_traffic

__all__ = ["DEFAULT_STAGING_CAP_BYTES", "POLICIES", "DryRunConfig", "build_maps", "dry_run", "replica_policy"]

POLICIES = ("lowest", "balanced")

DEFAULT_STAGING_CAP_BYTES = 64 << 20
"""The executor's default staging cap (``transport.stats.DEFAULT_STAGING_CAP_BYTES``; a test keeps them
equal). Not imported from there: the transport package imports torch, which the dry run does not need."""

_T = TypeVar("_T")


def replica_policy(name: str) -> ReplicaPolicy:
    """The planner's policy for a dry-run policy name."""
    if name == "lowest":
        return "lowest"
    if name == "balanced":
        return Spread()
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")


@dataclass(frozen=True)
class DryRunConfig:
    model: str
    trainer: TrainerLayout
    rollout: RolloutLayout
    policy: str = "balanced"
    staging_cap_bytes: int = DEFAULT_STAGING_CAP_BYTES
    bandwidth: Bandwidth = field(default_factory=Bandwidth)
    shared_nodes: bool = False
    dtype: str = "bfloat16"
    rounds: bool = True
    links: LinkFigures = GPU_LINKS


def build_maps(
    model: ModelTensors, trainer: TrainerLayout, rollout: RolloutLayout, dtype: str = "bfloat16"
) -> tuple[list[TensorMap], list[TensorMap]]:
    """Source maps of the trainer (ranks ``0..T-1``) and target maps of the engines (ranks ``T..``)."""
    check_fit(model, trainer, rollout)
    sources = trainer_maps(model, trainer.zero, trainer.dp, trainer.tp, trainer.ep, dtype)
    targets = vllm_target_maps(model, rollout.engines, rollout.tp, rollout.ep, trainer.world, dtype)
    return sources, targets


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _timed(fn: Callable[[], _T]) -> tuple[float, float, _T]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def _busiest(values: dict[int, int], ranks: Sequence[int]) -> int:
    return max(ranks, key=lambda r: (values.get(r, 0), -r))


def dry_run(config: DryRunConfig) -> dict[str, Any]:
    """Run the dry run of ``config``; a dict of figures (see the module docstring) and per-rank bytes."""
    trainer, rollout = config.trainer, config.rollout
    policy = replica_policy(config.policy)
    label, model = load_model(config.model)
    topology = Topology(
        trainer.world, rollout.world, trainer.gpus_per_node, rollout.gpus_per_node, config.shared_nodes
    )
    maps_cpu, maps_wall, (sources, targets) = _timed(
        lambda: build_maps(model, trainer, rollout, config.dtype)
    )
    gc.collect()
    gc.freeze()  # the maps live as long as the plan: keep the collector from rescanning them
    try:
        return _plan_and_measure(
            config, label, model, policy, topology, sources, targets, maps_cpu, maps_wall
        )
    finally:
        gc.unfreeze()


def _plan_and_measure(
    config: DryRunConfig,
    label: str,
    model: ModelTensors,
    policy: ReplicaPolicy,
    topology: Topology,
    sources: list[TensorMap],
    targets: list[TensorMap],
    maps_cpu: float,
    maps_wall: float,
) -> dict[str, Any]:
    trainer, rollout = config.trainer, config.rollout
    plan_cpu, plan_wall, plan = _timed(lambda: plan_model_by_layout(sources, targets, policy))

    traffic = plan_traffic(plan, topology)
    wire, slowest = modeled_seconds(traffic, config.bandwidth)
    bound = lower_bound(needed_bytes(sources, targets), traffic, topology, config.bandwidth)
    trainer_ranks = list(range(trainer.world))
    rollout_ranks = list(range(trainer.world, trainer.world + rollout.world))
    sent = [traffic.sent(r) for r in trainer_ranks]
    received = [traffic.received(r) for r in rollout_ranks]
    sent_by = dict(zip(trainer_ranks, sent, strict=True))
    recv_by = dict(zip(rollout_ranks, received, strict=True))
    top_sender = _busiest(sent_by, trainer_ranks)
    top_receiver = _busiest(recv_by, rollout_ranks)
    sample = sorted(
        {
            trainer_ranks[0],
            trainer_ranks[len(trainer_ranks) // 2],
            trainer_ranks[-1],
            top_sender,
            rollout_ranks[0],
            rollout_ranks[len(rollout_ranks) // 2],
            rollout_ranks[-1],
            top_receiver,
        }
    )
    half_times: dict[int, float] = {}
    disagree: list[int] = []
    kept = {}
    for rank in sample:
        first, _wall, _ = _timed(partial(plan_rank_half, sources, targets, rank, policy))
        second, _wall, half = _timed(partial(plan_rank_half, sources, targets, rank, policy))
        half_times[rank] = min(first, second)
        expected = (traffic.sent(rank), traffic.received(rank), traffic.local.get(rank, 0))
        if half.traffic() != expected or half.segment_count != traffic.half_segments.get(rank, 0):
            disagree.append(rank)
        if rank in (top_sender, top_receiver):
            kept[rank] = half
        del half
    objects: dict[int, Any] = {}
    objects_s = 0.0
    for rank, half in kept.items():
        cpu, _wall, objects[rank] = _timed(partial(half.with_digest, "(dry run: digest not computed)"))
        objects_s = max(objects_s, cpu)
    peak = _peak_rss_bytes()

    rounds: dict[str, Any] = {}
    if config.rounds:
        from .rounds import message_offers, rank_rounds  # imports the transport package, hence torch

        offers = message_offers(traffic, config.staging_cap_bytes)
        for role, rank in (("sender", top_sender), ("receiver", top_receiver)):
            cpu, _wall, rr = _timed(partial(rank_rounds, objects[rank], offers))
            rounds[role] = {
                "rank": rank,
                "rounds": rr.rounds,
                "messages": rr.messages,
                "message_bytes": rr.message_bytes,
                "staging_bytes": rr.staging_bytes,
                "refused": rr.refused,
                "schedule_s": round(cpu, 3),
                "overhead_s": overhead_seconds(rr.work, config.links) if rr.work is not None else None,
            }
    objects.clear()
    kept.clear()
    # the time model (``sync_model``): the wire from the per-link traffic model, plus what the busiest
    # sender and receiver spend besides it (agreement, copies, messages); without their schedules, the
    # agreement only
    overheads = [sum(r["overhead_s"].values()) for r in rounds.values() if r.get("overhead_s")]
    overhead = max(overheads, default=config.links.agree_s)
    modeled = wire + overhead

    half_bytes = [traffic.half_bytes.get(r, 0) for r in trainer_ranks + rollout_ranks]
    slowest_half = max(half_times, key=lambda r: (half_times[r], -r))
    model_bytes = sum(m.numel * ITEMSIZE[m.dtype] for m in sources)
    return {
        "model": label,
        "policy": config.policy,
        "trainer": str(trainer),
        "rollout": str(rollout),
        "dtype": config.dtype,
        "shared_nodes": config.shared_nodes,
        "intra_gbps": config.bandwidth.intra / 1e9,
        "inter_gbps": config.bandwidth.inter / 1e9,
        "staging_cap_bytes": config.staging_cap_bytes,
        "tensors": len(plan.tensors),
        "params": model.numel,
        "model_bytes": model_bytes,
        "source_pieces": sum(m.piece_count for m in sources),
        "target_pieces": sum(m.piece_count for m in targets),
        "segments": traffic.segments,
        "maps_s": round(maps_cpu, 3),
        "planner_s": round(plan_cpu, 3),
        "plan_s": round(maps_cpu + plan_cpu, 3),
        "plan_wall_s": round(maps_wall + plan_wall, 3),
        "rank_half_s": round(half_times[slowest_half], 3),
        "rank_half_rank": slowest_half,
        "rank_half_sample": {str(r): round(t, 3) for r, t in sorted(half_times.items())},
        "rank_half_objects_s": round(objects_s, 3),
        "halves_agree": not disagree,
        "peak_rss_bytes": peak,
        "max_send_bytes": max(sent),
        "mean_send_bytes": sum(sent) / len(sent),
        "max_recv_bytes": max(received),
        "mean_recv_bytes": sum(received) / len(received),
        "max_half_bytes": max(half_bytes),
        "mean_half_bytes": sum(half_bytes) / len(half_bytes),
        "modeled_s": modeled,
        "wire_s": wire,
        "overhead_s": overhead,
        "slowest_rank": slowest,
        "lower_bound_s": bound.seconds,
        "lower_bound_rank": bound.rank,
        "ratio": modeled / bound.seconds if bound.seconds else None,
        "rounds": rounds,
        "sent_per_trainer_rank": sent,
        "received_per_rollout_rank": received,
    }
