"""The ``rollout_sync`` backend of vLLM's weight-transfer API (worker side).

Lifecycle, as vLLM drives it (``LLM.*`` offline, the same names as HTTP routes on a server started with
``VLLM_SERVER_DEV_MODE=1``; every call reaches every worker):

1. ``init_weight_transfer_engine({"init_info": {"first_rank": R}})``: probe vLLM's loaders and build this
   worker's target maps (global rank ``R + tp_rank``). Optional ``tensors`` (name -> shape) replaces the
   checkpoint's tensor list. With ``"address": "tcp://HOST:PORT"`` (the trainer's coordinator), ``"engine"``
   and ``"token"``, the worker also joins the sync group (blocks until the trainer ranks attach).
2. ``start_weight_update()``: open an update (forwards refuse to run until it is finished; pause
   generation around the update on a server).
3. ``update_weights({"update_info": {}})``: receive the trainer's next sync straight into the parameters
   (the trainer ranks send at the same time, from their hook). Or ``{"update_info": {"checkpoint": path,
   "names": [...] | None}}``: write those tensors of a checkpoint through the maps, in place (refused
   tensors are staged for ``load_weights``).
4. ``finish_weight_update(weight_version=...)``: load staged tensors, rebuild derived copies (CPU MoE
   prepack), close the update. Then reset the prefix cache (``LLM.reset_prefix_cache()`` or
   ``/reset_prefix_cache``; ``/pause`` clears it too).

Tensors one worker's loaders refuse are not coordinated across workers on this path (the extension's
``vllm_plugin.driver.setup_engines`` does that); with refusals, drive the sync through the extension.
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
from rollout_sync.rollout.landing_maps import DEFAULT_MAX_PIECES
from rollout_sync.sync.options import SyncOptions

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
    maps: str = "fast"
    """How each worker learns its target maps: ``"fast"`` (from shapes, checked by a loader trace),
    ``"probe"`` (element probe) or ``"verify"`` (both, compared); see ``vllm_plugin.worker_maps``."""
    address: str = ""
    """The trainer's coordinator (``tcp://HOST:PORT``): join the sync group through the handshake (blocks
    until every trainer rank and worker has joined). Empty: updates come from checkpoints only."""
    engine: int = 0
    """This engine's index among the engines of the sync (engines are numbered from 0)."""
    token: str | None = None
    """The shared token; None: the ``ROLLOUT_SYNC_TOKEN`` environment variable."""
    timeout: float = SyncOptions.timeout
    """Seconds any wait of the handshake or of a sync may take."""
    atomic: bool = False
    """A sync lands whole or not at all: a failed one leaves the old weights (a copy of each worker's
    weights is held during a sync)."""


@dataclass
class RolloutSyncUpdateInfo(WeightTransferUpdateInfo):
    checkpoint: str = ""
    """A checkpoint (safetensors file or directory) to write through the maps. Empty: receive the next
    sync from the trainer over the sync group (after ``init_info.address``)."""
    names: list[str] | None = None
    """Tensors to write; None: every tensor this worker holds."""


class RolloutSyncWeightTransferEngine(WeightTransferEngine[RolloutSyncInitInfo, RolloutSyncUpdateInfo]):
    init_info_cls = RolloutSyncInitInfo
    update_info_cls = RolloutSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker: RolloutWorker | None = None
        self.link: Any = None
        self.last_report: dict[str, Any] | None = None

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
            maps=init_info.maps,
        )
        if init_info.address:
            from .worker_link import connect

            tp = get_tp_group()
            self.link = connect(
                self.worker,
                init_info.address,
                engine=init_info.engine,
                tp_rank=tp.rank_in_group,
                tp_size=tp.world_size,
                token=init_info.token,
                timeout=init_info.timeout,
                atomic=init_info.atomic,
            )

    def start_weight_update(self) -> None:
        self._worker().begin(atomic=self.link is not None and self.link.atomic)

    def receive_weights(self, update_info: RolloutSyncUpdateInfo) -> None:
        if update_info.checkpoint:
            self._worker().write_checkpoint(update_info.checkpoint, update_info.names)
            return
        if self.link is None:
            raise ValueError(
                "update_info.checkpoint is empty and this worker joined no sync group "
                "(pass init_info.address to init_weight_transfer_engine)"
            )
        from .worker_link import receive

        self.last_report = receive(self._worker(), self.link, open_update=False)

    def finish_weight_update(self) -> None:
        self._worker().finish()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.abort()
