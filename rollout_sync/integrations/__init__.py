"""rollout-sync inside the training frameworks people already run.

- ``trl``: TRL's ``GRPOTrainer`` (and every TRL trainer that syncs through ``VLLMGeneration``), server and
  colocate mode.
- ``trainer_callback``: the same sync as a ``transformers.TrainerCallback`` for other Trainer-based loops.
- ``weight_sync``: what they share: a DeepSpeed engine's trainer side and the vLLM engines' side of one
  sync group, attached once and synced on demand.
- ``engines``: the vLLM engines as a training process sees them: a server it drives over HTTP, or the
  engine that lives in this very process.
"""
