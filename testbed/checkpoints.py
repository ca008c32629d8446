"""A trainer's weights as a checkpoint, taken with DeepSpeed's own gathers (independent of rollout-sync's
maps, so it can check a sync): every logical tensor under the name ``save_pretrained`` writes.

``full_logical_tensors(engine)`` is collective (every rank calls it): ZeRO-3 parameters are gathered with
``GatheredParameters``, AutoTP shards all-gathered over the TP group and concatenated along AutoTP's
recorded ``partition_dim``, AutoEP packed experts all-gathered over the EP group and split into per-expert
checkpoint keys (``w1`` gate, ``w3`` up, ``w2`` down; the router ``mlp.router.gate`` is ``mlp.gate``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["full_logical_tensors", "save_checkpoint"]

_EXPERT_KEYS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _all_gather(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return parts


def _full_param(p: Any) -> torch.Tensor:
    import deepspeed

    if hasattr(p, "ds_tensor"):
        with deepspeed.zero.GatheredParameters([p]):
            local = p.data.detach().clone()
    else:
        local = p.data.detach().clone()
    local = local.reshape(tuple(getattr(p, "ds_shape", p.shape)))
    if hasattr(p, "ds_autoep_uc_meta"):
        from deepspeed.utils import groups

        return torch.cat(_all_gather(local, groups._get_expert_parallel_group(p.group_name)), dim=0)
    meta = getattr(p, "ds_autotp_universal_checkpoint_meta", None)
    if meta and not meta.get("replicated") and meta.get("partition_dim") is not None:
        from deepspeed.utils import groups

        parts = _all_gather(local, groups.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=int(meta["partition_dim"]))
    return local


def full_logical_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """Every logical tensor of the engine's low-precision weights (collective: call on every rank)."""
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

        layers = [n for n, m in engine.module.named_modules() if isinstance(m, AutoEPMoELayer)]
    except ImportError:
        layers = []
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        full = _full_param(p)
        layer = next((ln for ln in layers if name.startswith(ln + ".")), None)
        if layer is None:
            out[name] = full
            continue
        rest = name[len(layer) + 1 :]
        if rest == "router.gate.weight":
            out[f"{layer}.gate.weight"] = full
        else:
            key = _EXPERT_KEYS[rest.split(".")[-1]]
            for e in range(full.shape[0]):
                out[f"{layer}.experts.{e}.{key}.weight"] = full[e].clone()
    return out


def save_checkpoint(tensors: dict[str, torch.Tensor], model_dir: str | Path, out: str | Path) -> Path:
    """Write ``tensors`` as ``model.safetensors`` plus the config and tokenizer files of ``model_dir``."""
    from safetensors.torch import save_file

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, path / f.name)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return path
