"""rollout-sync as a ``transformers.TrainerCallback``, for Trainer-based loops other than TRL's::

    rollout = ColocatedRollout(llm, rank=dist.get_rank(), world=dist.get_world_size())  # or ServedRollout
    trainer.add_callback(RolloutSyncCallback(trainer, rollout))

When training begins (accelerate has built the DeepSpeed engine by then) every process attaches and syncs
once, so the engines start from exactly the trainer's weights; then it syncs after every optimizer step
(``on_step_end``: after the last micro-batch of a gradient-accumulation cycle, not after each micro-batch).
The trainer is needed for its accelerator: callbacks are handed the bare module, not the DeepSpeed engine.
Refused at train begin on every process, naming what was found: FSDP or any non-DeepSpeed
setup. ``callback.sync`` is the ``WeightSync`` (``history``, ``summary()``, ``after_sync`` hooks,
``detach()`` when the engines are done with).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from vllm_plugin.rollouts import RolloutSide

from .weight_sync import WeightSync, check_trainer, deepspeed_engine

__all__ = ["RolloutSyncCallback"]


class RolloutSyncCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, trainer: Any, rollout: RolloutSide, **options: Any) -> None:
        self.trainer = trainer
        self.sync = WeightSync(rollout, **options)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        accelerator = self.trainer.accelerator
        engine = deepspeed_engine(accelerator)
        check_trainer(engine, distributed_type=str(accelerator.distributed_type))
        if not self.sync.attached:
            self.sync.attach(engine)
        self.sync.sync(int(state.global_step))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sync.sync(int(state.global_step))
