"""Each side's storage geometry from shapes alone (pure: no torch process group, no DeepSpeed, no vLLM).

- ``deepspeed``: DeepSpeed 0.19.8's arithmetic: AutoTP splits, ZeRO storages and runs, the rank table.
- ``vllm``: vLLM 0.32's arithmetic: TP partitions, vocab padding, fused qkv / gate_up parts, expert placement.
- ``model_maps``: every map of a model for each side (``trainer_maps``, ``vllm_target_maps``), composed from
  the two; the dry run and the benchmarks call them, and the live adapters must produce identical maps.
"""

from .model_maps import trainer_maps, vllm_target_maps

__all__ = ["trainer_maps", "vllm_target_maps"]
