"""Shape tables: the logical tensors of model families (names, shapes, kinds) from a config, presets with
published shapes, and whole-model maps per side (``trainer_maps``, ``vllm_target_maps``) composed from
each side's geometry (``trainer.deepspeed_geometry``, ``rollout.vllm_geometry``)."""

from .presets import PRESETS, preset, preset_config
from .sides import trainer_maps, vllm_target_maps
from .tensors import KINDS, LogicalTensor, ModelTensors, model_tensors

__all__ = [
    "KINDS",
    "PRESETS",
    "LogicalTensor",
    "ModelTensors",
    "model_tensors",
    "preset",
    "preset_config",
    "trainer_maps",
    "vllm_target_maps",
]
