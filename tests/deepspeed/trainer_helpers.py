"""Checks of trainer storage maps against live DeepSpeed engines, run inside each rank.

The references are taken independently of the maps:

- before any step, the checkpoint the engine was loaded from (``safetensors``, saved names);
- after a step, DeepSpeed's own gathers: ``GatheredParameters`` for ZeRO-3 partitions,
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` for master weights and Adam states, then
  the TP shards and the EP ranks' packed experts put together by ``rollout_sync.trainer.reference.assembled`` (the
  same gathers the example and the end-to-end tests check syncs with), named as checkpoint keys by
  ``rollout_sync.trainer.reference.logical_tensors`` (that is, by ``rollout_sync.trainer.naming``).
  Those names are no oracle of the maps' names: the saved checkpoint is, before any step (every map
  name and every piece is compared with the ``safetensors`` file, AutoEP engines included).

Each rank compares its own storage views with its pieces of the reference, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from rollout_sync.layout.maps import TensorMap
from rollout_sync.trainer.reference import assembled, local_param, logical_tensors

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = INT_VIEW.get(a.dtype)
    if view is None:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def checkpoint_tensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.to(dtype) for k, v in load_file(str(path / "model.safetensors")).items()}


def compare_views(
    maps: list[TensorMap],
    views: Mapping[str, torch.Tensor],
    full: Mapping[str, torch.Tensor],
    rank: int,
    what: str,
) -> list[str]:
    """Every piece of this rank's storage of every map equals its box of the full tensor, bit for bit;
    ``views`` holds exactly the tensors the maps give this rank."""
    wrong: list[str] = []
    mine = {m.name for m in maps if rank in m.ranks}
    if set(views) != mine:
        wrong.append(
            f"{what}: views {sorted(set(views) ^ mine)[:4]} differ from the maps' names for rank {rank}"
        )
    for m in maps:
        if rank not in m.ranks:
            continue
        if m.name not in full:
            wrong.append(f"{what}: no reference tensor for {m.name}")
            continue
        ref = full[m.name]
        if tuple(ref.shape) != m.shape:
            wrong.append(f"{what}: {m.name} reference {tuple(ref.shape)} vs map {m.shape}")
            continue
        storage = m.ranks[rank]
        view = views.get(m.name)
        if view is None or tuple(view.shape) != storage.shape or view.dtype != ref.dtype:
            got = None if view is None else (tuple(view.shape), view.dtype)
            wrong.append(f"{what}: {m.name} view {got} vs storage {storage.shape} {ref.dtype}")
            continue
        for p in storage.pieces:
            got = torch.as_strided(view, p.box.extent, p.strides, view.storage_offset() + p.offset)
            exp = ref[tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))]
            if not same_bits(got, exp):
                wrong.append(f"{what}: {m.name} rank {rank} piece {p.box} differs")
    return wrong


# ----------------------------------------------------------------------------------------------------------
# Full tensors from DeepSpeed's own gathers
# ----------------------------------------------------------------------------------------------------------


def full_tensors(engine: Any, state: str) -> dict[str, torch.Tensor]:
    """Every logical tensor of ``state`` after DeepSpeed's own gathers (collective: all ranks call it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if state not in ("param", "fp32") and hasattr(opt, "_hp_optimizer_states_linked"):
        # DeepSpeed links _hp_mapping to the optimizer states once, after the first group's first step; with
        # several groups (AutoEP's expert group) the later groups' states do not exist yet and stay
        # unlinked, so safe_get_full_optimizer_state fails for them. Link again now that all exist.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    by_param: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if state == "param":
            local = local_param(p)
        elif state == "fp32":
            local = safe_get_full_fp32_param(p).detach().clone()
        else:
            local = safe_get_full_optimizer_state(p, state).detach().clone()
        by_param[name] = assembled(p, local)
    return logical_tensors(engine.module, by_param)


def timed(log: dict[str, float], label: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = fn()
    log[label] = log.get(label, 0.0) + time.perf_counter() - start
    return out


# ----------------------------------------------------------------------------------------------------------
# Several engines, one after the other, in one launch of ranks (the launch dominates the cost on a CPU)
# ----------------------------------------------------------------------------------------------------------


def _engines_main(
    rank: int, world_size: int, group: Any, specs: list[Any], paths: list[str], check: Callable[..., Any]
) -> list[Any]:
    import gc

    from tests.harness.deepspeed_engines import DeepSpeedRank, build_engine, init_deepspeed_distributed

    init_deepspeed_distributed(rank, world_size, group)
    results = []
    for spec, path in zip(specs, paths, strict=True):
        started = time.perf_counter()
        engine = build_engine(spec, path)
        ctx = DeepSpeedRank(rank, world_size, group, spec, Path(path), engine, time.perf_counter() - started)
        try:
            results.append(check(ctx))
        finally:
            engine.destroy()
            del ctx, engine
            gc.collect()
            tdist.barrier()
    return results


def run_engines(
    specs: list[Any], paths: list[Path], check: Callable[..., Any], world_size: int, timeout: float = 900.0
) -> list[list[Any]]:
    """``check(ctx)`` on each engine of ``specs`` in turn (built from ``paths``), in one launch of
    ``world_size`` ranks; per rank, the results in spec order. Engines with AutoTP must come after engines
    without it (AutoTP's groups are process-wide), and one launch uses one AutoTP and one AutoEP size."""
    from tests.harness.ranks import run_on_ranks

    return run_on_ranks(_engines_main, world_size, specs, [str(p) for p in paths], check, timeout=timeout)
