"""The ``rollout_sync`` backend of vLLM's weight-transfer API (worker side).

Lifecycle, as vLLM drives it (``LLM.*`` offline, the same names as HTTP routes on a server started with
``VLLM_SERVER_DEV_MODE=1``; every call reaches every worker):

1. ``init_weight_transfer_engine({"init_info": {"first_rank": R}})``: probe vLLM's loaders and build this
   worker's target maps (global rank ``R + tp_rank``). Optional ``tensors`` (name -> shape) replaces the
   checkpoint's tensor list.
2. ``start_weight_update()``: open an update (forwards refuse to run until it is finished; pause
   generation around the update on a server).
3. ``update_weights({"update_info": {"checkpoint": path, "names": [...] | None}})``: write those tensors
   of a checkpoint through the maps, in place (refused tensors are staged for ``load_weights``).
4. ``finish_weight_update(weight_version=...)``: load staged tensors, rebuild derived copies (CPU MoE
   prepack), close the update. Then reset the prefix cache (``LLM.reset_prefix_cache()`` or
   ``/reset_prefix_cache``; ``/pause`` clears it too).

The engine owns no process group yet; transport-driven updates use the same ``RolloutWorker`` session
(``storage(name)`` / ``mark_written(name)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rollout_sync.errors import IncompleteUpdateError
from rollout_sync.rollout.probe import DEFAULT_MAX_PIECES

from .worker_state import RolloutWorker

__all__ = ["RolloutSyncInitInfo", "RolloutSyncUpdateInfo", "RolloutSyncWeightTransferEngine"]


@dataclass
class RolloutSyncInitInfo(WeightTransferInitInfo):
    first_rank: int = 0
    """Global rank of this engine's TP rank 0 in the sync group."""
    tensors: dict[str, list[int]] | None = None
    """Logical tensors (name -> shape); None: the tensors of the checkpoint the engine was started from."""
    max_pieces: int = DEFAULT_MAX_PIECES
    """Most affine pieces one storage may need before its loader is refused."""


@dataclass
class RolloutSyncUpdateInfo(WeightTransferUpdateInfo):
    checkpoint: str = ""
    """A checkpoint (safetensors file or directory) to write through the maps."""
    names: list[str] | None = None
    """Tensors to write; None: every tensor this worker holds."""


class RolloutSyncWeightTransferEngine(WeightTransferEngine[RolloutSyncInitInfo, RolloutSyncUpdateInfo]):
    init_info_cls = RolloutSyncInitInfo
    update_info_cls = RolloutSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker: RolloutWorker | None = None

    def _worker(self) -> RolloutWorker:
        if self.worker is None:
            raise IncompleteUpdateError("init_weight_transfer_engine has not run on this worker")
        return self.worker

    def init_transfer_engine(self, init_info: RolloutSyncInitInfo) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        self.worker = RolloutWorker.setup(
            self.model,
            self.vllm_config,
            tp_rank=get_tp_group().rank_in_group,
            first_rank=init_info.first_rank,
            tensors=init_info.tensors,
            max_pieces=init_info.max_pieces,
        )

    def start_weight_update(self) -> None:
        self._worker().begin()

    def receive_weights(self, update_info: RolloutSyncUpdateInfo) -> None:
        if not update_info.checkpoint:
            raise ValueError("update_info.checkpoint is required (a safetensors file or directory)")
        self._worker().write_checkpoint(update_info.checkpoint, update_info.names)

    def finish_weight_update(self) -> None:
        self._worker().finish()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.abort()
