"""A PEFT LoRA model under DeepSpeed: which trainer parameters are its adapter, under which logical names,
and what vLLM must be told to serve it (pure: reads a PEFT config as a dict).

PEFT names the adapter's parameters ``base_model.model.{module}.lora_A.{adapter}.weight`` (``[r, in]``) and
``...lora_B.{adapter}.weight`` (``[out, r]``) and saves them as ``base_model.model.{module}.lora_A.weight``;
their logical names here drop PEFT's ``base_model.model.`` prefix and the adapter's name:
``{module}.lora_A.weight`` (as ``rollout_sync.rollout.lora_maps`` names the targets).

An adapter sync moves those tensors only; the base weights stay where they are. vLLM folds PEFT's scaling
into B when it loads an adapter: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (vLLM's
``PEFTHelper``, which agrees with PEFT's ``LoraLayer``). What vLLM cannot serve is refused here, as vLLM's
``PEFTHelper.validate_legal`` would refuse the saved adapter: another adapter type, DoRA, a bias, modules to
save, per-module ranks or alphas (one slot rank per adapter), several adapters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import UnsupportedLayoutError
from ..layout.maps import TensorMap

__all__ = [
    "AdapterConfig",
    "adapter_config",
    "adapter_maps",
    "adapter_storage",
    "adapter_tensor_name",
    "peft_adapter",
]

_PARAM = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<which>lora_[AB])\.(?P<adapter>[^.]+)\.weight$"
)


def adapter_tensor_name(param: str, adapter: str = "default") -> str | None:
    """The logical name of a PEFT adapter parameter of adapter ``adapter``, or None for any other."""
    m = _PARAM.match(param)
    if m is None or m["adapter"] != adapter:
        return None
    return f"{m['module']}.{m['which']}.weight"


@dataclass(frozen=True)
class AdapterConfig:
    """What a rollout engine needs to serve the adapter: its PEFT name, rank, scaling and target modules."""

    adapter: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...] | None

    def spec(self, name: str, lora_id: int) -> dict[str, Any]:
        """The rollout side's adapter spec (``vllm_plugin.lora_slots.AdapterSpec``) for vLLM name ``name``."""
        return {
            "name": name,
            "lora_id": lora_id,
            "rank": self.rank,
            "scaling": self.scaling,
            "target_modules": None if self.target_modules is None else list(self.target_modules),
        }


def _refuse(what: str, found: object, fix: str) -> UnsupportedLayoutError:
    return UnsupportedLayoutError(
        f"{what} cannot be synced into vLLM's LoRA slots", expected=fix, found=found
    )


def adapter_config(configs: Mapping[str, Mapping[str, Any]]) -> AdapterConfig:
    """The adapter of a PEFT model's ``peft_config`` (adapter name -> ``LoraConfig.to_dict()``); raises
    ``UnsupportedLayoutError`` for what vLLM cannot serve."""
    if len(configs) != 1:
        raise _refuse("a PEFT model with several adapters", sorted(configs), "one adapter")
    adapter, config = next(iter(configs.items()))
    kind = str(config.get("peft_type", "")).rsplit(".", 1)[-1].upper()
    if kind != "LORA":
        raise _refuse(f"a {kind or 'unknown'} adapter", kind, "a LoRA adapter (peft.LoraConfig)")
    if config.get("use_dora"):
        raise _refuse("a DoRA adapter", "use_dora=True", "use_dora=False")
    if str(config.get("bias", "none")) != "none" or config.get("lora_bias"):
        raise _refuse("an adapter with biases", config.get("bias"), 'bias="none", lora_bias=False')
    if config.get("modules_to_save"):
        raise _refuse(
            "an adapter with modules to save", config.get("modules_to_save"), "modules_to_save=None"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise _refuse(
            "an adapter with per-module ranks or alphas",
            {"rank_pattern": config.get("rank_pattern"), "alpha_pattern": config.get("alpha_pattern")},
            "one r and one lora_alpha",
        )
    rank = int(config["r"])
    alpha = float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    modules: tuple[str, ...] | None
    if isinstance(targets, str):
        modules = None if targets == "all-linear" else (targets,)
        if modules is not None and not targets.isidentifier():
            raise _refuse("target modules given as a regular expression", targets, "a list of module names")
    else:
        modules = None if targets is None else tuple(sorted(str(t) for t in targets))
    return AdapterConfig(adapter, rank, scaling, modules)


def adapter_maps(maps: Sequence[TensorMap], adapter: str = "default") -> list[TensorMap]:
    """The maps of the adapter's A and B under their logical names; the base weights' maps are left out.
    Raises ``UnsupportedLayoutError`` when the model holds no parameter of ``adapter``."""
    out = []
    for m in maps:
        name = adapter_tensor_name(m.name, adapter)
        if name is not None:
            out.append(replace(m, name=name))
    if not out:
        raise _refuse("a model without LoRA parameters", adapter, "a PEFT model from peft.get_peft_model")
    return out


def adapter_storage(
    maps: Sequence[TensorMap], sources: Mapping[str, Any], adapter: str = "default"
) -> tuple[list[TensorMap], dict[str, Any]]:
    """``adapter_maps`` and this rank's views of them (keyed by logical name, as the maps)."""
    kept = adapter_maps(maps, adapter)
    views = {}
    for name, view in sources.items():
        renamed = adapter_tensor_name(name, adapter)
        if renamed is not None:
            views[renamed] = view
    return kept, views


def peft_adapter(engine: Any) -> AdapterConfig | None:
    """The adapter of a DeepSpeed engine whose module is a PEFT model (its ``peft_config``), else None."""
    configs = getattr(getattr(engine, "module", None), "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    return adapter_config({name: _as_dict(c) for name, c in configs.items()})


def _as_dict(config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else vars(config)
