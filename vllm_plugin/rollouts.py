"""The vLLM engines of a sync group, as one training process sees them.

Every training process holds one ``RolloutSide`` and calls the same methods in the same order (the
trainer ranks are collective); what each does depends on where the engines are:

- ``ServedRollout``: one ``vllm serve`` server with ``RolloutSyncExtension`` (TRL's server mode). Training
  process 0 drives it over HTTP (``vllm_plugin.http_driver``); the others have nothing to do.
- ``ColocatedRollout``: every training process holds its own ``vllm.LLM`` built with
  ``distributed_executor_backend="external_launcher"`` (TRL's colocate mode): engine ``rank // tp``, its
  worker ``rank % tp`` lives in this very process. This process is then two ranks of the sync group: a
  trainer rank and that worker. The worker's half runs on a thread beside the trainer's; their messages to
  each other are in-process copies (``transport.in_process``), only the rest crosses processes.

The calls that block until the whole group has acted (connect, receive) return a ``Background``: the
caller runs the trainer half meanwhile and joins it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from rollout_sync.errors import UnsupportedLayoutError
from rollout_sync.sync.background import Background

__all__ = ["ColocatedRollout", "RolloutSide", "ServedRollout"]


class RolloutSide(Protocol):
    engines: int

    def coordinator_host(self) -> str:
        """The address training process 0 serves the coordinator on: one the engines reach."""
        ...

    def prepare(self, trainer_world: int) -> dict[str, Any]:
        """Learn the engines' target maps (collective over the training processes)."""
        ...

    def connect(self, address: str, token: str, timeout: float, staging_cap_bytes: int) -> Background | None:
        """Join the sync group through the coordinator at ``address`` (None: nothing to do here)."""
        ...

    def receive(self, timeout: float) -> Background | None:
        """Receive one sync, then make the engines serve the new weights (prefix caches reset)."""
        ...

    def changed_by(self, checkpoint: str) -> list[str]:
        """Write ``checkpoint`` through vLLM's own loader maps and name the parameters whose bytes that
        changed (empty: the engines held exactly the checkpoint's weights)."""
        ...


class ServedRollout:
    """A ``vllm serve`` server with ``RolloutSyncExtension`` at ``url``, driven by training process 0."""

    engines = 1

    def __init__(self, url: str, *, driver: bool, timeout: float = 120.0) -> None:
        from vllm_plugin.http_driver import ServerEngine

        self.url = url
        self.server = ServerEngine(url, name=f"server {url}", timeout=timeout) if driver else None

    def coordinator_host(self) -> str:
        """This host's address on the route to the server (its workers connect back along it)."""
        from urllib.parse import urlparse

        from rollout_sync.transport.core.network import route_source

        url = urlparse(self.url)
        return route_source(url.hostname or "127.0.0.1", url.port or 80)

    def prepare(self, trainer_world: int) -> dict[str, Any]:
        if self.server is None:
            return {}
        from vllm_plugin.driver import setup_engines

        targets = setup_engines([self.server], first_rank=trainer_world)
        return {"engine_tensors": len(targets.maps)}

    def connect(self, address: str, token: str, timeout: float, staging_cap_bytes: int) -> Background | None:
        if self.server is None:
            return None
        from vllm_plugin.driver import connect_engine

        return Background(
            f"{self.url} joining the sync group",
            connect_engine,
            self.server,
            address,
            0,
            token=token,
            timeout=timeout,
            staging_cap_bytes=staging_cap_bytes,
        )

    def receive(self, timeout: float) -> Background | None:
        if self.server is None:
            return None
        # pause (clears the prefix cache), receive, resume, set the weight version
        return Background(f"{self.url} receiving a sync", self.server.receive, timeout=timeout)

    def changed_by(self, checkpoint: str) -> list[str]:
        if self.server is None:
            return []
        from vllm_plugin.driver import verify_engine

        return verify_engine(self.server, checkpoint)


def _in_process_worker(llm: Any) -> Any:
    """The vLLM worker object an ``external_launcher`` engine runs in this process."""
    try:
        wrapper = llm.llm_engine.model_executor.driver_worker
    except AttributeError as exc:
        raise UnsupportedLayoutError(
            "colocate mode needs the vLLM engine in this process (LLM(..., distributed_executor_backend="
            f"'external_launcher')); found no in-process worker: {exc}"
        ) from exc
    return getattr(wrapper, "worker", wrapper)


class ColocatedRollout:
    """This process's own ``vllm.LLM`` (``external_launcher``): engine ``rank // tp``, worker ``rank % tp``
    (the TP groups TRL and vLLM build: consecutive training ranks)."""

    def __init__(self, llm: Any, *, rank: int, world: int) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        self.llm = llm
        self.vllm_worker = _in_process_worker(llm)
        tp = get_tp_group()
        self.tp_rank = int(tp.rank_in_group)
        self.tp = int(tp.world_size)
        if world % self.tp or rank % self.tp != self.tp_rank:
            raise UnsupportedLayoutError(
                f"training rank {rank} of {world} holds vLLM worker {self.tp_rank} of a TP-{self.tp} engine; "
                f"colocate mode needs engine k on training ranks [k*{self.tp}, (k+1)*{self.tp})"
            )
        self.engine = rank // self.tp
        self.engines = world // self.tp
        self.worker: Any = None
        self.link: Any = None

    def coordinator_host(self) -> str:
        return "127.0.0.1"  # every engine lives in these training processes

    def prepare(self, trainer_world: int) -> dict[str, Any]:
        import torch.distributed as dist

        from vllm_plugin.worker_state import RolloutWorker

        w = self.vllm_worker
        self.worker = RolloutWorker.setup(
            w.model_runner.model,
            w.vllm_config,
            tp_rank=self.tp_rank,
            first_rank=trainer_world + self.engine * self.tp,
        )
        # One map per tensor: a tensor some worker refuses to write in place is staged whole on all.
        refused = sorted(self.worker.summary()["refused"])
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, refused)
        union = sorted({name for names in every for name in names})
        if union:
            self.worker.force_fallback(union, "staged whole on every worker: refused for in-place writes")
        return dict(self.worker.summary())

    def connect(self, address: str, token: str, timeout: float, staging_cap_bytes: int) -> Background | None:
        from vllm_plugin.worker_link import connect

        def join() -> dict[str, Any]:
            self.link = connect(
                self.worker,
                address,
                engine=self.engine,
                tp_rank=self.tp_rank,
                tp_size=self.tp,
                token=token,
                timeout=timeout,
                staging_cap_bytes=staging_cap_bytes,
            )
            return dict(self.link.status())

        return Background(f"engine {self.engine} worker {self.tp_rank} joining the sync group", join)

    def receive(self, timeout: float) -> Background | None:
        from vllm_plugin.worker_link import receive

        def run() -> dict[str, Any]:
            report = receive(self.worker, self.link)
            self.llm.reset_prefix_cache()
            return report

        return Background(f"engine {self.engine} worker {self.tp_rank} receiving a sync", run)

    def changed_by(self, checkpoint: str) -> list[str]:
        before = self.worker.param_digests()
        self.worker.apply_checkpoint(str(Path(checkpoint)))
        self.llm.reset_prefix_cache()
        after = self.worker.param_digests()
        return sorted(n for n in before if after.get(n) != before[n])
