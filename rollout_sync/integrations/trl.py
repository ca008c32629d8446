"""TRL: rollout-sync as the weight sync of ``GRPOTrainer`` (and every TRL trainer that syncs through
``trl.generation.vllm_generation.VLLMGeneration``), with DeepSpeed, in server and colocate mode.

Two lines, before the trainer is built::

    from rollout_sync.integrations.trl import use_rollout_sync
    sync = use_rollout_sync()                 # TRL's weight sync becomes rollout-sync's
    trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate" or "server", ...))

TRL syncs in one place, ``VLLMGeneration.sync_weights``: every rank calls it, once per global step (its
step guard, ``_last_loaded_step``, also on the ``rollout_func`` path), before generating. ``use_rollout_sync``
replaces that method, so TRL's step logic (gradient accumulation, ``steps_per_generation``) decides when, and
rollout-sync decides how: at the first call every rank attaches to the DeepSpeed engine accelerate built;
then each call sends each rank's own shard straight into the vLLM workers that store it, no gather.

- Server mode: the server runs the rollout-sync worker extension (``python -m vllm_plugin.serve serve
  MODEL --worker-extension-cls vllm_plugin.extension.RolloutSyncExtension`` with ``VLLM_SERVER_DEV_MODE=1``);
  TRL's NCCL communicator is neither created nor used (``VLLMClient.init_communicator`` is skipped);
  generation still goes through TRL's client.
- Colocate mode: each training process's own ``LLM`` is that process's vLLM worker; the pieces this
  process's trainer rank stores and its worker needs are copied in process, only the rest moves between
  processes.

Refused at the first sync on every rank, before any byte moves: FSDP or any non-DeepSpeed setup, vLLM's
sleep mode (it frees and re-allocates the weights the maps point into). A PEFT model (``peft_config``)
syncs merged: each rank merges the base weights it stores with the adapter (``rollout_sync.trainer.merged``),
where TRL gathers the whole model on every rank to merge it.

Other Trainer-based loops: ``rollout_sync.integrations.trainer_callback.RolloutSyncCallback``.
"""

from __future__ import annotations

from typing import Any

from vllm_plugin.rollouts import ColocatedRollout, RolloutSide, ServedRollout

from ..errors import UnsupportedLayoutError
from ..sync.options import SyncOptions
from .weight_sync import WeightSync, check_trainer, deepspeed_engine

__all__ = ["TrlWeightSync", "rollout_side", "use_rollout_sync"]


class TrlWeightSync(WeightSync):
    """The sync behind ``VLLMGeneration.sync_weights``: its rollout side is built from the generation
    object at the first call (the server TRL's client talks to, or the colocated ``LLM``)."""

    def sync_generation(self, generation: Any) -> None:
        accelerator = generation.accelerator
        if not self.attached:
            engine = deepspeed_engine(accelerator)
            check_trainer(engine, distributed_type=str(accelerator.distributed_type))
            if getattr(generation, "enable_sleep_mode", False):
                raise UnsupportedLayoutError(
                    "rollout-sync does not sync into a vLLM engine in sleep mode yet (vllm_enable_sleep_mode: "
                    "level 2 frees the weights the maps point into)"
                )
            self.attach(engine, rollout_side(generation))
        self.sync(int(getattr(self.engine, "global_steps", 0)))


def rollout_side(generation: Any) -> RolloutSide:
    """The vLLM side of a ``VLLMGeneration`` in this process."""
    accelerator = generation.accelerator
    if generation.mode == "server":
        client = getattr(generation, "vllm_client", None)
        url = client.base_url if client is not None else ""
        return ServedRollout(url, driver=accelerator.is_main_process, timeout=generation.server_timeout)
    if generation.mode == "colocate":
        return ColocatedRollout(
            generation.llm, rank=accelerator.process_index, world=accelerator.num_processes
        )
    raise UnsupportedLayoutError(f"unknown vLLM mode {generation.mode!r} (expected 'server' or 'colocate')")


_installed: TrlWeightSync | None = None


def use_rollout_sync(
    *,
    host: str | None = None,
    options: SyncOptions | None = None,
    **overrides: Any,
) -> TrlWeightSync:
    """Make TRL's weight sync rollout-sync's in this process; call it before building the trainer (server
    mode: TRL's NCCL communicator is set up while the trainer is built). ``host``: where training process 0
    listens for the vLLM workers; by default this host's address on the route to TRL's server (server
    mode) or loopback (colocate mode).
    ``options`` (``SyncOptions``, or its fields as keywords: ``delta=True`` syncs after the first send only
    the weights that changed; ``timeout``, ``staging_cap_bytes``, ...). Returns the sync
    (``history``, ``summary()``, ``after_sync`` hooks). Calling it again returns the same."""
    global _installed
    if _installed is not None:
        return _installed
    from trl.generation import vllm_client, vllm_generation

    sync = TrlWeightSync(host=host, options=SyncOptions.of(options, **overrides))

    def sync_weights(generation: Any) -> None:
        sync.sync_generation(generation)

    def init_communicator(client: Any, device: Any = 0) -> None:
        """rollout-sync moves the weights: TRL's NCCL group to the server is not built."""

    vllm_generation.VLLMGeneration.sync_weights = sync_weights  # type: ignore[method-assign]
    vllm_client.VLLMClient.init_communicator = init_communicator  # type: ignore[method-assign,assignment]
    _installed = sync
    return sync
