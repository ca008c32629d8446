"""rollout-sync as vLLM's trainer-side weight-transfer engine: a framework that drives vLLM's trainer API
switches to it by the init info it builds, the calls staying the same and in the same order.

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
    from vllm_plugin.trainer_engine import RolloutSyncTrainerInitInfo   # instead of NCCLTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=RolloutSyncTrainerInitInfo(master_address=host, master_port=port, world_size=0, rank=rank),
        client=HTTPVLLMWeightSyncClient("http://vllm-host:8000"),   # or RayVLLMWeightSyncClient(llm)
        source=ModuleSource(deepspeed_engine),
    )
    engine.send_weights()   # once per sync, on every trainer rank

The inference side starts with ``--weight-transfer-config '{"backend": "rollout_sync"}'`` (the worker-side
backend, ``vllm_plugin.weight_transfer``). ``trainer_init`` runs on every DeepSpeed rank: rank 0 asks the
workers to join (``client.init_weight_transfer_engine`` with the coordinator's address, a fresh token and
the workers' first global rank) while every rank attaches (``TrainerSync``: each rank describes its own
storage, rank 0 coordinates at ``tcp://master_address:master_port``). ``send_weights`` is one sync: rank 0
drives ``start_weight_update``, ``update_weights`` (the workers receive) and ``finish_weight_update`` with the
version, while every rank sends its half straight from DeepSpeed's storage. Nothing is gathered.

**What it reads.** A DeepSpeed engine: ``init_info.engine``, or the source's module when the source is
``ModuleSource(deepspeed_engine)`` (a ``DeepSpeedEngine`` is a module). Other sources (a plain module,
FSDP's DTensors, a Megatron export) are refused with ``UnsupportedLayoutError`` on every rank before any
byte moves: rollout-sync reads a trainer's storage, which it knows for DeepSpeed's ZeRO-0..3, AutoTP and
AutoEP layouts only. ``world_size`` is accepted for parity with the NCCL backend's init info and not used:
the handshake learns every rank.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from rollout_sync.errors import UnsupportedLayoutError
from rollout_sync.sync.options import SyncOptions

__all__ = ["BACKEND", "RolloutSyncTrainerEngine", "RolloutSyncTrainerInitInfo", "register"]

BACKEND = "rollout_sync"


@dataclass
class RolloutSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``rollout_sync`` backend (the NCCL backend's fields, and rollout-sync's
    own options)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int = 0
    engine: Any = field(default=None, repr=False)  # the DeepSpeed engine (else the source's module)
    token: str | None = None  # None: one drawn on rank 0 and shared with the other ranks
    timeout: float = SyncOptions.timeout
    atomic: bool = False  # a failed sync leaves the workers' old weights (``UpdateSession``)
    delta: bool = SyncOptions.delta  # after the first sync, send only what changed (``transport.delta``)
    staging_cap_bytes: int = SyncOptions.staging_cap_bytes


def _deepspeed_engine(init_info: RolloutSyncTrainerInitInfo, source: Any) -> Any:
    if init_info.engine is not None:
        return init_info.engine
    module = getattr(source, "_module", None)
    if module is not None and type(module).__name__ in ("DeepSpeedEngine", "DeepSpeedHybridEngine"):
        return module
    raise UnsupportedLayoutError(
        "the rollout_sync backend reads a DeepSpeed engine's storage: pass it as "
        "RolloutSyncTrainerInitInfo(engine=...) or ModuleSource(deepspeed_engine), not "
        f"{type(source).__name__} over {type(module).__name__ if module is not None else 'nothing'}"
    )


class RolloutSyncTrainerEngine(TrainerWeightTransferEngine[RolloutSyncTrainerInitInfo]):
    init_info_cls = RolloutSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sync: Any = None  # rollout_sync.trainer.hook.TrainerSync

    @classmethod
    def trainer_init(
        cls, init_info: RolloutSyncTrainerInitInfo, *, client: Any, source: Any = None
    ) -> RolloutSyncTrainerEngine:
        import torch.distributed as dist

        from rollout_sync.trainer.hook import TrainerSync

        engine = cls(client=client, source=source, is_sender=init_info.rank == 0)
        deepspeed_engine = _deepspeed_engine(init_info, source)
        world = dist.get_world_size()
        shared = [init_info.token or secrets.token_hex(16)]
        dist.broadcast_object_list(shared, src=0)  # one token: rank 0's
        address = f"tcp://{init_info.master_address}:{init_info.master_port}"
        worker_info = {
            "first_rank": world,
            "address": address,
            "engine": 0,
            "token": shared[0],
            "timeout": init_info.timeout,
            "atomic": init_info.atomic,
        }
        with ThreadPoolExecutor(max_workers=1) as pool:
            # the workers block in init_weight_transfer_engine until every rank has joined
            joining = (
                pool.submit(client.init_weight_transfer_engine, worker_info) if engine.is_sender else None
            )
            engine.sync = TrainerSync.attach(
                deepspeed_engine,
                address=address,
                engines=1,
                token=shared[0],
                every=None,
                options=SyncOptions(
                    timeout=init_info.timeout,
                    staging_cap_bytes=init_info.staging_cap_bytes,
                    delta=init_info.delta,
                ),
            )
            if joining is not None:
                joining.result(init_info.timeout + 30)
        return engine

    def send_weights(self) -> None:
        """One sync: every rank sends its half; rank 0 drives the workers' update round trip and names the
        version the trainer sent."""
        if not self.is_sender:
            self.sync.sync()
            return
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            receiving = pool.submit(self.client.update_weights, {})
            result = self.sync.sync()
            receiving.result(self.sync.endpoint.options.timeout + 30)
        self.client.finish_weight_update(weight_version=str(result.version))

    def shutdown(self) -> None:
        if self.sync is not None:
            self.sync.detach()
            self.sync = None


def register() -> None:
    """Register the engine with vLLM's ``WeightTransferTrainerFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND in WeightTransferTrainerFactory._registry:
        return
    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, RolloutSyncTrainerEngine)
    except ValueError:  # registered meanwhile
        if BACKEND not in WeightTransferTrainerFactory._registry:
            raise


register()  # importing the init info makes the factory find its engine
