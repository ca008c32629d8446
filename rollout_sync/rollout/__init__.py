"""The rollout side, independent of vLLM (no module here imports vLLM; ``vllm_plugin`` wraps these with
vLLM's objects inside vLLM's processes).

- where vLLM 0.32 stores each logical element (fused qkv, gate_up, MoE w13/w2, padded vocab shards) from
  shapes and the engine's parallel config is ``rollout_sync.geometry.vllm`` (pure);
- ``storage_view``: where a logical tensor's storage sits in a vLLM parameter (or a staging buffer);
- ``shape_targets``: one worker's target maps from the model's shapes; ``check``: their check against
  traces of vLLM's loaders;
- ``landings``: the observations of a loader probe (``vllm_plugin.probing`` probes); ``landing_maps``: one
  tensor's map and storage view from its landings; ``local_targets``: one worker's part of the target maps
  (``LocalTargets``, also what ``shape_targets`` returns) from its landings, a refused tensor's staging map;
- ``fleet_maps``: a fleet's merged and coverage-checked targets; ``lora_maps``: where a LoRA adapter's A and
  B land in a vLLM LoRA slot; ``codec``: their plain-data form;
- ``checkpoint``: the logical tensors of a checkpoint;
- ``group_link``: a worker's link to the sync group (connect, receive, commit);
- ``apply``: in-place writes into storage views and derived-copy rebuilds.
"""
