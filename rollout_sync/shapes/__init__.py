"""Model shape tables (logical tensors and their kinds) and whole-model map builders per side."""

from .presets import PRESETS, preset, preset_config
from .sides import autotp_layout, trainer_maps, trainer_rank_table, vllm_engine_ranks, vllm_target_maps
from .tensors import KINDS, LogicalTensor, ModelTensors, model_tensors

__all__ = [
    "KINDS",
    "PRESETS",
    "LogicalTensor",
    "ModelTensors",
    "autotp_layout",
    "model_tensors",
    "preset",
    "preset_config",
    "trainer_maps",
    "trainer_rank_table",
    "vllm_engine_ranks",
    "vllm_target_maps",
]
