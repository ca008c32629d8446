"""Shared steps of the rollout tests on real vLLM CPU engines: snapshots (greedy tokens and every
parameter's SHA-256), the comparison of probed maps with the pure builder, and the round trip that writes
one checkpoint into an engine started from another."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_sync.geometry.model_maps import vllm_target_maps
from rollout_sync.layout.maps import TensorMap
from rollout_sync.rollout.check import canonical_map
from rollout_sync.rollout.fleet_maps import RolloutTargets
from rollout_sync.shapes.tensors import model_tensors
from tests.harness.vllm_engines import DEFAULT_PROMPTS, VllmEngine
from vllm_plugin.driver import apply_checkpoint, setup_engines


@dataclass(frozen=True)
class Snapshot:
    tokens: list[list[int]]
    digests: list[dict[str, str]]  # per worker: parameter name -> sha256
    # per worker: loaded form of each parameter of a layer kept in another form -> sha256, as the last
    # update wrote it (empty unless the engine records them: ``rollout_sync_record_loaded``)
    loaded: list[dict[str, str]] = field(default_factory=list)


def snapshot(engine: VllmEngine) -> Snapshot:
    return Snapshot(
        engine.generate_greedy(DEFAULT_PROMPTS, max_tokens=12),
        [dict(d) for d in engine.collective_rpc("rollout_sync_param_digests")],
        [dict(d) for d in engine.collective_rpc("rollout_sync_loaded_digests")],
    )


def differing_params(a: Snapshot, b: Snapshot) -> list[tuple[int, str]]:
    assert len(a.digests) == len(b.digests)
    out = []
    for rank, (x, y) in enumerate(zip(a.digests, b.digests, strict=True)):
        assert x.keys() == y.keys()
        out += [(rank, name) for name in sorted(x) if x[name] != y[name]]
    return out


def canonical(m: TensorMap) -> Any:
    """A map's content without its representation's freedom (``check.canonical_map``: shape, dtype, per rank
    the storage shape and sorted pieces, strides of axes of extent 1 dropped)."""
    return canonical_map(m)


def builder_differences(
    probed: Mapping[str, TensorMap], model_dir: Path, engines: int, tp: int, first_rank: int, ep: int = 1
) -> list[str]:
    """Where the probed maps differ from ``vllm_target_maps`` (the pure builder) for the same fleet."""
    config = json.loads((model_dir / "config.json").read_text())
    built = {
        m.name: m for m in vllm_target_maps(model_tensors(config), engines, tp, ep=ep, first_rank=first_rank)
    }
    diffs = []
    for name in sorted(set(probed) | set(built)):
        if name not in probed or name not in built:
            diffs.append(f"{name}: only in {'probed' if name in probed else 'built'} maps")
            continue
        a, b = probed[name], built[name]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            diffs.append(f"{name}: probed {a.shape} {a.dtype}, built {b.shape} {b.dtype}")
        elif canonical(a) != canonical(b):
            diffs.append(f"{name}: probed {canonical(a)} built {canonical(b)}")
    return diffs


@dataclass(frozen=True)
class RoundTrip:
    """An engine started from checkpoint ``a`` receives checkpoint ``b`` through its maps."""

    fresh: Snapshot  # the engine as started from a
    written: Snapshot  # after writing b through the maps
    targets: RolloutTargets
    reports: list[Any]
    uncovered: list[dict[str, list[list[int]]]]


def round_trip(engine: VllmEngine, b: Path, first_rank: int = 0) -> RoundTrip:
    fresh = snapshot(engine)
    targets = setup_engines([engine.llm], first_rank)
    after_probe = snapshot(engine)
    assert after_probe == fresh, "probing changed the engine"
    reports = apply_checkpoint([engine.llm], str(b))[0]
    written = snapshot(engine)
    uncovered = engine.collective_rpc("rollout_sync_uncovered")
    return RoundTrip(fresh, written, targets, reports, uncovered)
