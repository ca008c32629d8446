"""rollout-sync as a ``transformers.TrainerCallback``, for Trainer-based loops other than TRL's::

    trainer.add_callback(RolloutSyncCallback(trainer, llm))  # this process's own vllm.LLM (colocated)
    trainer.add_callback(RolloutSyncCallback(trainer, "http://HOST:8000"))  # or a `vllm serve` server

The rollout side is this process's ``vllm.LLM`` (``external_launcher``, as TRL's colocate mode builds it:
``ColocatedRollout``), a server's URL (driven by process 0: ``ServedRollout``), or a ``RolloutSide`` built
by hand.

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

from vllm_plugin.rollouts import ColocatedRollout, RolloutSide, ServedRollout

from ..sync.options import SyncOptions
from .weight_sync import WeightSync, check_trainer, deepspeed_engine

__all__ = ["RolloutSyncCallback"]


class RolloutSyncCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, trainer: Any, rollout: RolloutSide | str | Any, **options: Any) -> None:
        self.trainer = trainer
        self.sync = WeightSync(_rollout_side(rollout, options.get("timeout")), **options)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        accelerator = self.trainer.accelerator
        engine = deepspeed_engine(accelerator)
        check_trainer(engine, distributed_type=str(accelerator.distributed_type))
        if not self.sync.attached:
            self.sync.attach(engine)
        self.sync.sync(int(state.global_step))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sync.sync(int(state.global_step))


def _rollout_side(rollout: RolloutSide | str | Any, timeout: float | None) -> RolloutSide:
    """A server URL or this process's ``vllm.LLM`` as a ``RolloutSide``; a ``RolloutSide`` as it is."""
    import torch.distributed as dist

    if isinstance(rollout, (ColocatedRollout, ServedRollout)) or not (
        isinstance(rollout, str) or hasattr(rollout, "llm_engine")
    ):
        return rollout  # type: ignore[no-any-return]
    if not dist.is_initialized():
        raise RuntimeError(
            "RolloutSyncCallback(trainer, llm or url): build it after the Trainer (its process group)"
        )
    if isinstance(rollout, str):
        wait = SyncOptions.timeout if timeout is None else timeout
        return ServedRollout(rollout, driver=dist.get_rank() == 0, timeout=wait)
    return ColocatedRollout(rollout, rank=dist.get_rank(), world=dist.get_world_size())
