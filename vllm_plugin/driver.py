"""Driver-side helpers for one or several vLLM engines loaded with ``RolloutSyncExtension``.

An engine is anything with vLLM's ``collective_rpc(method, args=(), kwargs=None)`` (``vllm.LLM``; an
``AsyncLLM`` needs an async wrapper). Engines are numbered in the order given: engine ``k``'s workers are
global ranks ``first_rank + (workers of engines before k) + tp_rank``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_sync.errors import PeerFailedError
from rollout_sync.rollout.codec import local_targets_from_dict
from rollout_sync.rollout.probe import DEFAULT_MAX_PIECES
from rollout_sync.rollout.targets import RolloutTargets, assemble

__all__ = ["apply_checkpoint", "setup_engines"]


def setup_engines(
    engines: Sequence[Any],
    first_rank: int = 0,
    *,
    tensors: Mapping[str, Sequence[int]] | None = None,
    max_pieces: int = DEFAULT_MAX_PIECES,
) -> RolloutTargets:
    """Probe every worker of every engine and return the merged, coverage-checked target maps."""
    ranks: list[tuple[int, ...]] = []
    refused: dict[str, list[int]] = {}
    next_rank = first_rank
    for engine in engines:
        summaries = engine.collective_rpc(
            "rollout_sync_setup",
            kwargs={
                "first_rank": next_rank,
                "tensors": {k: list(v) for k, v in tensors.items()} if tensors else None,
                "max_pieces": max_pieces,
            },
        )
        got = tuple(int(s["rank"]) for s in summaries)
        expected = tuple(range(next_rank, next_rank + len(summaries)))
        if got != expected:
            raise PeerFailedError(f"engine {len(ranks)} reported ranks {got}, expected {expected}")
        for s in summaries:
            for name in s["refused"]:
                refused.setdefault(name, []).append(int(s["rank"]))
        ranks.append(got)
        next_rank += len(summaries)
    for name, holders in sorted(refused.items()):
        # One map per tensor: a tensor refused on some rank is staged whole on every rank.
        reason = f"staged whole on every rank: refused for in-place writes on ranks {sorted(holders)}"
        for engine in engines:
            engine.collective_rpc("rollout_sync_fallback", args=([name], reason))
    workers = []
    for engine in engines:
        workers += [local_targets_from_dict(d) for d in engine.collective_rpc("rollout_sync_local_targets")]
    return assemble(workers, ranks)


def apply_checkpoint(
    engines: Sequence[Any], path: str, names: Sequence[str] | None = None
) -> list[list[Any]]:
    """Write a checkpoint into every engine through the maps (one call per engine, so no generation runs
    in between on that engine), then reset each engine's prefix cache. Returns each worker's report."""
    reports = []
    for engine in engines:
        reports.append(list(engine.collective_rpc("rollout_sync_apply_checkpoint", args=(str(path), names))))
        reset = getattr(engine, "reset_prefix_cache", None)
        if callable(reset):
            reset()
    return reports
