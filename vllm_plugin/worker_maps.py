"""How one vLLM worker learns its target maps: from shapes, checked by a loader trace, or by the element
probe.

``maps`` chooses:

- ``"fast"`` (default): for a model type whose vLLM layout the shape tables know (``rollout_sync.shapes``),
  the maps come from the model's shapes and the engine's parallel config (``shape_targets``) and are
  confirmed on the live engine by tracing its loaders on the meta device (``tracing.trace_loads`` then
  ``check.check_targets``; a disagreement raises ``TargetMismatchError``). Tensors the trace cannot follow
  (a loader that transforms values), and every tensor of a model type the tables do not know, are probed
  element by element (``probing.probe_model``).
- ``"probe"``: the element probe for every tensor (any architecture, any loader).
- ``"verify"``: the fast path, then the element probe of every tensor; the two must describe the same
  storage for every element (``check.target_differences``) or ``TargetMismatchError`` is raised.

Run inside ``LoadedForms.probing()``: layers vLLM keeps in another form are in their loaded form then.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from rollout_sync.errors import LayoutError, TargetMismatchError
from rollout_sync.layout.dtypes import dtype_name
from rollout_sync.rollout.check import check_targets, target_differences
from rollout_sync.rollout.local_targets import LocalTargets, TargetsBuilder
from rollout_sync.rollout.shape_targets import shape_targets
from rollout_sync.shapes.tensors import model_tensors

__all__ = ["MAPS_MODES", "find_targets"]

MAPS_MODES = ("fast", "probe", "verify")


def _from_shapes(
    model: torch.nn.Module, vllm_config: Any, shapes: Mapping[str, tuple[int, ...]], rank: int, tp_rank: int
) -> LocalTargets:
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    config = vllm_config.model_config.hf_config.to_dict()
    return shape_targets(
        model_tensors(config),
        shapes,
        {n: dtype_name(p.dtype) for n, p in model.named_parameters()},
        rank=rank,
        tp_rank=tp_rank,
        tp=tp,
        ep=tp if getattr(parallel, "enable_expert_parallel", False) else 1,
        placement=str(getattr(parallel, "expert_placement_strategy", "linear")),
    )


def _probe(
    model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]], rank: int, dtype: str, max_pieces: int
) -> LocalTargets:
    from .probing import probe_model

    builder = TargetsBuilder(rank, fallback_dtype=dtype, max_pieces=max_pieces)
    probe_model(
        model,
        shapes,
        rank=rank,
        observe=lambda seen: builder.add(
            seen.name, seen.shape, seen.dtype or dtype, seen.landings, seen.error
        ),
    )
    return builder.build()


def _combine(
    shapes: Mapping[str, tuple[int, ...]],
    rank: int,
    fast: LocalTargets | None,
    probed: LocalTargets | None,
    probe_names: set[str],
) -> LocalTargets:
    """Per tensor, the probed targets for ``probe_names``, the fast ones for the others; in ``shapes``
    order."""
    maps, views, refused, absent = {}, {}, {}, []
    for name in shapes:
        part = probed if name in probe_names else fast
        if part is None:
            continue
        if name in part.maps:
            maps[name], views[name] = part.maps[name], part.views[name]
            if name in part.refused:
                refused[name] = part.refused[name]
        elif name in part.absent:
            absent.append(name)
    return LocalTargets(rank, maps, views, refused, tuple(absent))


def find_targets(
    model: torch.nn.Module,
    vllm_config: Any,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    rank: int,
    tp_rank: int,
    max_pieces: int,
    maps: str = "fast",
) -> tuple[LocalTargets, dict[str, Any]]:
    """This worker's targets and a report: ``maps`` (the mode), ``from_shapes`` (tensors whose maps came
    from shapes, confirmed by the trace), ``probed`` (tensors probed element by element), ``why_probed``
    (why the shape tables were not used, or None), ``trace_seconds``, ``probe_seconds``, ``verify_seconds``
    and ``seconds`` (all of it)."""
    if maps not in MAPS_MODES:
        raise ValueError(f"maps must be one of {MAPS_MODES}, found {maps!r}")
    from .tracing import trace_loads

    started = time.perf_counter()
    dtype = vllm_config.model_config.dtype
    report: dict[str, Any] = {"maps": maps, "why_probed": None, "trace_seconds": 0.0, "verify_seconds": 0.0}
    fast: LocalTargets | None = None
    to_probe = list(shapes)
    if maps != "probe":
        try:
            fast = _from_shapes(model, vllm_config, shapes, rank, tp_rank)
        except LayoutError as exc:  # a model type, tensor or parameter the shape tables do not describe
            report["why_probed"] = str(exc)
        else:
            traced = time.perf_counter()
            to_probe = check_targets(fast, shapes, trace_loads(model, shapes, dtype))
            report["trace_seconds"] = time.perf_counter() - traced
            if to_probe:
                report["why_probed"] = "the loader trace cannot follow these tensors' loaders"
    # under ``verify`` the element probe covers every tensor once, and serves those the trace could not
    # follow too
    everything = maps == "verify" and fast is not None
    probe_started = time.perf_counter()
    probed = (
        _probe(
            model,
            shapes if everything else {n: shapes[n] for n in to_probe},
            rank,
            dtype_name(dtype),
            max_pieces,
        )
        if everything or to_probe
        else None
    )
    report["probe_seconds"] = time.perf_counter() - probe_started
    targets = _combine(shapes, rank, fast, probed, set(to_probe))
    if everything and probed is not None:
        report["verify_seconds"] = report["probe_seconds"]
        differ = target_differences(targets, probed)
        if differ:
            raise TargetMismatchError(
                "the targets built from shapes differ from the element probe's",
                rank=rank,
                expected="identical targets",
                found=f"{len(differ)} differences, first: {differ[:3]}",
            )
    report["from_shapes"] = 0 if fast is None else len(shapes) - len(to_probe)
    report["probed"] = len(to_probe)
    report["seconds"] = time.perf_counter() - started
    return targets, report
