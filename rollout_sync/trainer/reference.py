"""Reference checkpoints: a trainer's weights as a checkpoint, taken with DeepSpeed's own gathers (independent
of rollout-sync's maps, so it can check a sync, ``TrainerSync.save_reference``): every logical tensor under
the name ``save_pretrained`` writes.

``full_logical_tensors(engine)`` is collective (every rank calls it): ZeRO-3 parameters are gathered with
``GatheredParameters``, AutoTP shards all-gathered over the TP group and concatenated along AutoTP's
recorded ``partition_dim``, AutoEP packed experts all-gathered over the EP group. ``logical_tensors`` then
names them: AutoEP's packed experts split into per-expert checkpoint keys (``w1`` gate, ``w3`` up, ``w2``
down) and its router ``mlp.router.gate`` renamed ``mlp.gate``, by the product's own translation
(``rollout_sync.trainer.naming``; ``tests/deepspeed/test_trainer_storage.py`` checks it against a
checkpoint ``save_pretrained`` wrote).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .engine.parts import autoep_layers
from .naming import autoep_expert_parts, autoep_router_name

__all__ = [
    "assembled",
    "full_logical_tensors",
    "local_param",
    "logical_tensors",
    "save_adapter",
    "save_checkpoint",
    "save_merged",
]


def _all_gather(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return parts


def local_param(p: Any) -> torch.Tensor:
    """This rank's copy of parameter ``p``'s low-precision data: the whole parameter under ZeRO-3 (gathered
    with ``GatheredParameters``), else the rank's own (AutoTP or AutoEP) shard. Collective under ZeRO-3."""
    import deepspeed

    if hasattr(p, "ds_tensor"):
        with deepspeed.zero.GatheredParameters([p]):
            return p.data.detach().clone()
    return p.data.detach().clone()


def assembled(p: Any, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of parameter ``p`` (any state of it) from this rank's ``local`` one: AutoEP's packed
    experts all-gathered over the EP group (EP rank ``k`` packs experts ``[k·L, (k+1)·L)``), AutoTP shards
    all-gathered over the TP group and concatenated along the recorded ``partition_dim``; anything else is
    ``local`` itself. Collective over those groups."""
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


def logical_tensors(module: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full parameters ``full`` of ``module`` (by parameter name) as logical tensors, under the names
    ``save_pretrained`` writes, by ``rollout_sync.trainer.naming``: a parameter outside AutoEP layers is its
    own logical tensor; an AutoEP router parameter takes the preset's router name; a packed expert
    parameter ``[E, ...]`` is split into its per-expert tensors (copies)."""
    layers = autoep_layers(module)
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        layer = next((ln for ln in layers if name.startswith(ln + ".")), None)
        if layer is None:
            out[name] = t
            continue
        family = str(layers[layer].model_family)
        rest = name[len(layer) + 1 :]
        if rest.startswith("router.gate."):
            from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

            router = PRESET_MODELS[family].router_pattern
            out[autoep_router_name(family, layer, router, rest[len("router.gate.") :])] = t
            continue
        for part in autoep_expert_parts(family, layer, rest.rsplit(".", 1)[-1], t.shape):
            box = t[tuple(slice(o, o + e) for o, e in zip(part.origin, part.extent, strict=True))]
            out[part.name] = box.reshape(part.shape).clone()
    return out


def full_logical_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """Every logical tensor of the engine's low-precision weights (collective: call on every rank)."""
    return logical_tensors(
        engine.module, {name: assembled(p, local_param(p)) for name, p in engine.module.named_parameters()}
    )


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


def save_adapter(engine: Any, out: str | Path) -> list[str]:
    """What PEFT's ``save_pretrained`` writes for the adapter of a PEFT model under DeepSpeed, from
    DeepSpeed's own gathers (``adapter_config.json``, ``adapter_model.safetensors`` with keys
    ``base_model.model.{module}.lora_A.weight``): vLLM loads it with ``LoRARequest(name, id, out)``.
    Collective; rank 0 writes. Returns the saved keys."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    adapter = {}
    for name, p in engine.module.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            key = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            adapter[key] = local_param(p).contiguous()
    if dist.get_rank() == 0:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        engine.module.peft_config["default"].save_pretrained(str(out))
        save_file(adapter, str(out / "adapter_model.safetensors"))
    return sorted(adapter)


def save_merged(engine: Any, model_dir: str | Path, out: str | Path) -> Path | None:
    """PEFT's own ``merge_and_unload`` of the trainer's model as a checkpoint: every parameter gathered with
    DeepSpeed's own gathers, loaded on rank 0 into a fresh PEFT model with the engine's own LoRA config (in
    the dtype the trainer holds them), merged and unloaded by PEFT, saved under checkpoint names.
    Collective; rank 0 writes (returns the path)."""
    import copy

    import torch.distributed as dist
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    full = {name: local_param(p) for name, p in engine.module.named_parameters()}
    if dist.get_rank() != 0:
        return None
    dtype = next(iter(full.values())).dtype
    config = copy.deepcopy(engine.module.peft_config["default"])
    import transformers.integrations.deepspeed as hf_deepspeed

    # inside accelerate's ZeRO-3 job from_pretrained would build under zero.Init (collective): not here
    zero3 = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = zero3
    # PEFT makes adapters fp32; the trainer (DeepSpeed bf16) holds them in ``dtype``
    model = get_peft_model(base, config).to(dtype)
    missing, unexpected = model.load_state_dict(full, strict=False)
    if unexpected or any(".lora_" in n or "base_layer" in n for n in missing):
        raise RuntimeError(f"gathered parameters do not fit the PEFT model: {missing[:3]} {unexpected[:3]}")
    merged = model.merge_and_unload()
    names = {id(p): n for n, p in merged.named_parameters()}  # tied weights once, under their first name
    tensors = {n: p.data for n, p in merged.named_parameters() if names[id(p)] == n}
    return save_checkpoint(tensors, model_dir, out)
