"""rollout-sync inside the training frameworks people already run.

- ``trl``: TRL's ``GRPOTrainer`` (and every TRL trainer that syncs through ``VLLMGeneration``), server and
  colocate mode.
- ``trainer_callback``: the same sync as a ``transformers.TrainerCallback`` for other Trainer-based loops.
- ``weight_sync``: what they share: a DeepSpeed engine's trainer side and the vLLM engines' side of one
  sync group, attached once and synced on demand (the engines as a training process sees them, a server
  it drives over HTTP or the engine in this very process, are ``vllm_plugin.rollouts``).
- ``ray``: trainer ranks and engines placed by Ray meet through a rendezvous actor.
"""
