"""Dry-run descriptions: the model, the trainer layout and the rollout layout, parsed and checked against
each other before any map is built.

- model: a bundled preset name (``rollout_sync.shapes.presets``: published shape numbers only) or the path
  of a Hugging Face ``config.json`` (or of the directory holding it);
- trainer: ``"zero=3,tp=1,ep=64,world=256[,gpus_per_node=8]"`` (ZeRO stage, AutoTP size, AutoEP size,
  number of trainer GPUs; the data-parallel size is ``world / tp``);
- rollout: ``"engines=8,tp=16[,ep=16][,gpus_per_node=8]"`` (vLLM engines, TP size per engine, expert
  parallelism per engine: 1 or the TP size).

Every problem is one ``DryRunSpecError`` whose message names it (an unknown key, sizes that do not divide,
a TP size above the head count) so that the command prints one line, not a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import DryRunSpecError
from ..shapes.presets import PRESETS, preset_config
from ..shapes.tensors import ModelTensors, model_tensors

__all__ = ["RolloutLayout", "TrainerLayout", "check_fit", "load_model", "parse_rollout", "parse_trainer"]


@dataclass(frozen=True, slots=True)
class TrainerLayout:
    """A DeepSpeed engine: ``world`` GPUs, AutoTP size ``tp``, AutoEP size ``ep``, ZeRO stage ``zero``."""

    zero: int
    world: int
    tp: int = 1
    ep: int = 1
    gpus_per_node: int = 8

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def __str__(self) -> str:
        return f"zero={self.zero},tp={self.tp},ep={self.ep},world={self.world},gpus_per_node={self.gpus_per_node}"


@dataclass(frozen=True, slots=True)
class RolloutLayout:
    """``engines`` vLLM engines of ``tp`` workers each; ``ep`` is 1 or ``tp`` (expert parallelism over the
    engine's workers)."""

    engines: int
    tp: int
    ep: int = 1
    gpus_per_node: int = 8

    @property
    def world(self) -> int:
        return self.engines * self.tp

    def __str__(self) -> str:
        return f"engines={self.engines},tp={self.tp},ep={self.ep},gpus_per_node={self.gpus_per_node}"


def _fields(text: str, what: str, known: tuple[str, ...], required: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise DryRunSpecError(f"{what} layout item {item!r} is not key=value (keys: {', '.join(known)})")
        if key not in known:
            raise DryRunSpecError(f"unknown {what} layout key {key!r}", expected=f"one of {known}", found=key)
        if key in out:
            raise DryRunSpecError(f"{what} layout key {key!r} given twice in {text!r}")
        try:
            number = int(value.strip())
        except ValueError:
            raise DryRunSpecError(
                f"{what} layout {key}={value.strip()!r} is not an integer (items are key=value, separated"
                " by commas)"
            ) from None
        if number < (0 if key == "zero" else 1):
            raise DryRunSpecError(f"{what} layout {key}={number} must be positive")
        out[key] = number
    missing = [k for k in required if k not in out]
    if missing:
        raise DryRunSpecError(f"{what} layout {text!r} lacks {', '.join(missing)} (keys: {', '.join(known)})")
    return out


def parse_trainer(text: str) -> TrainerLayout:
    """``"zero=3,tp=1,ep=64,world=256[,gpus_per_node=8]"``; ``tp``, ``ep`` default to 1."""
    f = _fields(text, "trainer", ("zero", "tp", "ep", "world", "gpus_per_node"), ("zero", "world"))
    layout = TrainerLayout(f["zero"], f["world"], f.get("tp", 1), f.get("ep", 1), f.get("gpus_per_node", 8))
    if layout.zero not in (0, 1, 2, 3):
        raise DryRunSpecError(f"trainer ZeRO stage must be 0, 1, 2 or 3, not {layout.zero}")
    if layout.world % layout.tp:
        raise DryRunSpecError(
            f"trainer world={layout.world} is not divisible by tp={layout.tp}",
            expected=f"a multiple of {layout.tp}",
            found=layout.world,
        )
    if layout.ep > 1 and layout.tp > 1:
        raise DryRunSpecError(
            f"trainer AutoEP (ep={layout.ep}) with AutoTP (tp={layout.tp}): DeepSpeed 0.19.8 refuses the"
            " experts' tensor-parallel plan",
            expected="tp=1 with ep>1",
            found=f"tp={layout.tp}",
        )
    if layout.dp % layout.ep:
        raise DryRunSpecError(
            f"trainer ep={layout.ep} does not divide the data-parallel size {layout.dp} (world / tp)",
            expected=f"a divisor of {layout.dp}",
            found=layout.ep,
        )
    return layout


def parse_rollout(text: str) -> RolloutLayout:
    """``"engines=8,tp=16[,ep=16][,gpus_per_node=8]"``; ``ep`` defaults to 1."""
    f = _fields(text, "rollout", ("engines", "tp", "ep", "gpus_per_node"), ("engines", "tp"))
    layout = RolloutLayout(f["engines"], f["tp"], f.get("ep", 1), f.get("gpus_per_node", 8))
    if layout.ep not in (1, layout.tp):
        raise DryRunSpecError(
            f"rollout ep={layout.ep}: vLLM's expert parallelism spans the engine's TP ranks",
            expected=f"ep=1 or ep=tp={layout.tp}",
            found=layout.ep,
        )
    return layout


def load_model(name_or_config: str) -> tuple[str, ModelTensors]:
    """``(label, logical tensors)`` of a preset name or a ``config.json`` path (a directory holding one
    works too)."""
    if name_or_config in PRESETS:
        return name_or_config, model_tensors(preset_config(name_or_config))
    path = Path(name_or_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise DryRunSpecError(
            f"model {name_or_config!r} is neither a preset nor a config.json file",
            expected=f"one of {sorted(PRESETS)} or a path",
            found=name_or_config,
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DryRunSpecError(f"cannot read {str(path)!r} as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise DryRunSpecError(f"{str(path)!r} holds a JSON {type(config).__name__}, not an object")
    return str(path), model_tensors(config)


def check_fit(model: ModelTensors, trainer: TrainerLayout, rollout: RolloutLayout) -> None:
    """Refuse layouts that cannot hold ``model``, with the reason (the map builders would refuse them too,
    naming a tensor; this names the layout)."""
    heads, kv = model.num_heads, model.num_kv_heads
    experts = model.num_experts
    if trainer.tp > heads:
        raise DryRunSpecError(
            f"trainer tp={trainer.tp} is above the model's {heads} attention heads",
            expected=f"tp <= {heads}",
            found=trainer.tp,
        )
    if trainer.ep > 1 and experts == 0:
        raise DryRunSpecError(f"trainer ep={trainer.ep} but the model has no routed experts")
    if experts and trainer.ep > 1 and experts % trainer.ep:
        raise DryRunSpecError(
            f"trainer ep={trainer.ep} does not divide the model's {experts} experts",
            expected=f"a divisor of {experts}",
            found=trainer.ep,
        )
    if experts and trainer.tp > 1:
        raise DryRunSpecError(
            f"trainer tp={trainer.tp} on a MoE model: DeepSpeed 0.19.8 AutoTP does not partition experts",
            expected="tp=1 (use ep for the experts)",
            found=trainer.tp,
        )
    t = rollout.tp
    if t > heads:
        raise DryRunSpecError(
            f"rollout tp={t} is above the model's {heads} attention heads", expected=f"tp <= {heads}", found=t
        )
    if heads % t:
        raise DryRunSpecError(
            f"rollout tp={t} does not divide the model's {heads} attention heads",
            expected=f"a divisor of {heads}",
            found=t,
        )
    if model.model_type in ("qwen3", "qwen3_moe") and (kv % t if t <= kv else t % kv):
        raise DryRunSpecError(
            f"rollout tp={t} is neither a divisor nor a multiple of the model's {kv} kv heads"
        )
    if rollout.ep > 1 and experts == 0:
        raise DryRunSpecError(f"rollout ep={rollout.ep} but the model has no routed experts")
    if experts and rollout.ep == 1 and model.moe_intermediate_size % t:
        raise DryRunSpecError(
            f"rollout tp={t} does not divide the experts' intermediate size {model.moe_intermediate_size}"
            " (use ep=tp)"
        )
