"""The rollout side, independent of vLLM (no module here imports vLLM; ``vllm_plugin`` wraps these with
vLLM's objects inside vLLM's processes).

- ``vllm_geometry``: where vLLM 0.32 stores each logical element (fused qkv, gate_up, MoE w13/w2, padded
  vocab shards), from shapes and the engine's parallel config (pure);
- ``shape_targets``: one worker's target maps from the model's shapes; ``check``: their check against
  traces of vLLM's loaders; ``probe``: target maps from loader-probe observations;
- ``targets``: a fleet's merged and coverage-checked targets; ``codec``: their plain-data form;
- ``checkpoint``: the logical tensors of a checkpoint;
- ``group_link``: a worker's link to the sync group (connect, receive, commit);
- ``apply``: in-place writes into storage views and derived-copy rebuilds.
"""
