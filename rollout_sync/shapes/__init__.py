"""Shape tables: the logical tensors of model families (names, shapes, kinds) from a config, and presets with
published shapes. A leaf: it imports nothing of the package but ``layout`` and the errors. The whole-model
maps per side (``trainer_maps``, ``vllm_target_maps``) are composed from these in ``rollout_sync.geometry``."""

from .presets import PRESETS, preset, preset_config
from .tensors import KINDS, LogicalTensor, ModelTensors, model_tensors

__all__ = [
    "KINDS",
    "PRESETS",
    "LogicalTensor",
    "ModelTensors",
    "model_tensors",
    "preset",
    "preset_config",
]
