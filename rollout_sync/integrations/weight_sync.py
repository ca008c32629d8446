"""One sync group between a DeepSpeed engine's training processes and the vLLM engines they feed.

``WeightSync.attach(engine)`` (every training process, collectively) picks the coordinator's address and a
token on process 0 and shares them over the training job's own process group, learns the vLLM side's
target maps, then joins: the trainer rank through ``TrainerSync.attach`` (no step hook: the framework
decides when to sync) and the vLLM side through its ``RolloutSide``, both at once. ``sync()`` then moves
the weights: each trainer rank sends its half while the rollout side receives, and returns once every rank
of the group has committed.

Refused before any byte moves, naming what was found: a model that is not a DeepSpeed engine (FSDP, DDP,
a bare module). A PEFT LoRA model syncs merged (``TrainerSync.attach(..., lora="merged")``): the engines a
framework starts have no LoRA, so they get the base weights merged with the adapter, as the framework's own
sync gives them (without gathering the base weights).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_plugin.rollouts import RolloutSide

from ..errors import UnsupportedLayoutError
from ..sync.background import Background
from ..sync.endpoint import SyncResult
from ..sync.options import SyncOptions

__all__ = ["WeightSync", "changed_fraction", "check_trainer", "deepspeed_engine", "is_peft"]


def deepspeed_engine(accelerator: Any) -> Any:
    """The DeepSpeed engine accelerate built for the model being trained (None before ``prepare``)."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine


def is_peft(model: Any) -> bool:
    from accelerate.utils import is_peft_model

    return bool(is_peft_model(model))


def check_trainer(engine: Any, *, distributed_type: str = "DEEPSPEED") -> None:
    """Refuse what the integration does not handle, naming it (pure: no process group)."""
    if str(distributed_type).upper().removeprefix("DISTRIBUTEDTYPE.") != "DEEPSPEED":
        raise UnsupportedLayoutError(
            f"rollout-sync syncs from DeepSpeed engines (ZeRO 0-3, AutoTP, AutoEP); found distributed type "
            f"{distributed_type!s} (FSDP and DDP are not supported yet)"
        )
    if engine is None or not hasattr(engine, "zero_optimization_stage"):
        raise UnsupportedLayoutError(
            f"rollout-sync needs the DeepSpeed engine the model trains in; found {type(engine).__name__}"
        )


def changed_fraction(result: SyncResult) -> float | None:
    """Of the elements this rank compared in a delta sync, the share that had changed (None: a full sync)."""
    stats = result.stats
    if stats.delta_base is None or not stats.elements_compared:
        return None
    return round(stats.elements_changed / stats.elements_compared, 6)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class WeightSync:
    """A DeepSpeed engine's training processes and the vLLM engines of ``rollout``, in one sync group.

    ``host``: where training process 0 serves the coordinator (the vLLM workers connect to it); by default
    the rollout side's choice (``RolloutSide.coordinator_host``: the address of this host that routes to a
    server, loopback for engines in these processes). ``state``: ``param`` (the weights the model trains, as TRL syncs them) or
    ``fp32`` (ZeRO's master weights). ``delta``: after the first sync, send only the elements that changed
    (``transport.delta``: each training process keeps a copy of what it sent, the bytes it sends per sync;
    segments copied within a process, as in TRL's colocate mode, are copied whole)."""

    def __init__(
        self,
        rollout: RolloutSide | None = None,
        *,
        host: str | None = None,
        port: int | None = None,
        token: str | None = None,
        state: str = "param",
        options: SyncOptions | None = None,
        **overrides: Any,
    ) -> None:
        self.rollout = rollout
        self.options = SyncOptions.of(options, **overrides)
        self.delta = self.options.delta
        self.host = host
        self.port = port
        self.token = token
        self.timeout = self.options.timeout
        self.staging_cap_bytes = self.options.staging_cap_bytes
        self.state = state
        self.engine: Any = None
        self.trainer: Any = None  # rollout_sync.trainer.hook.TrainerSync
        self.setup: dict[str, Any] = {}
        self.history: list[SyncResult] = []
        self.after_sync: list[Callable[[WeightSync], None]] = []

    @property
    def attached(self) -> bool:
        return self.trainer is not None

    def attach(self, engine: Any, rollout: RolloutSide | None = None) -> None:
        """Join the sync group (collective over the training processes, which must all call it). A failure
        to learn the vLLM side's maps on any process (a layout vLLM's loaders do not reveal, a server
        without the extension) is raised on every process, naming it, before anyone joins."""
        import torch.distributed as dist

        from ..trainer.hook import TrainerSync

        if rollout is not None:
            self.rollout = rollout
        if self.rollout is None:
            raise ValueError("no rollout side: pass the vLLM engines' RolloutSide")
        started = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        meeting: list[Any] = [None, None, None]
        if rank == 0:
            host = self.host or self.rollout.coordinator_host()
            meeting = [host, self.port or _free_port(host), self.token or secrets.token_hex(16)]
        dist.broadcast_object_list(meeting, src=0)
        address, token = f"tcp://{meeting[0]}:{int(meeting[1])}", str(meeting[2])
        probe_started = time.perf_counter()
        failure = ""
        rollout_setup: dict[str, Any] = {}
        try:
            rollout_setup = self.rollout.prepare(world)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        failures: list[Any] = [None] * world
        dist.all_gather_object(failures, failure)
        bad = [(r, f) for r, f in enumerate(failures) if f]
        if bad:
            raise UnsupportedLayoutError(
                "the vLLM side cannot take part in the sync: "
                + "; ".join(f"training process {r}: {f}" for r, f in bad)
            )
        probe_s = time.perf_counter() - probe_started
        joining = self.rollout.connect(address, token, self.timeout, self.staging_cap_bytes)
        with self._beside(joining):
            self.trainer = TrainerSync.attach(
                engine,
                address=address,
                engines=self.rollout.engines,
                token=token,
                every=None,
                state=self.state,
                options=self.options,
                lora="merged",  # a PEFT model: the framework's engines have no LoRA (else unused)
            )
        self.engine = engine
        self.setup = {
            "attach_s": round(time.perf_counter() - started, 3),
            "rollout_setup_s": round(probe_s, 3),
            "engines": self.rollout.engines,
            **{
                k: v
                for k, v in rollout_setup.items()
                if k in ("maps_seconds", "probe_seconds", "engine_tensors")
            },
        }

    def sync(self, version: int | None = None) -> SyncResult:
        """Move the trainer's current weights into every engine (collective over the training processes)."""
        if self.trainer is None or self.rollout is None:
            raise RuntimeError("attach(engine) first")
        receiving = self.rollout.receive(self.timeout)
        with self._beside(receiving):
            result = self.trainer.sync(version)
        self.history.append(result)
        for hook in self.after_sync:
            hook(self)
        return result

    @contextlib.contextmanager
    def _beside(self, background: Background | None) -> Iterator[None]:
        """Run the trainer half while ``background`` (the rollout half) runs, then join it. When the trainer
        half fails, its error is the one raised (the rollout half's, which it usually causes, is dropped
        once that thread has ended)."""
        try:
            yield
        except BaseException:
            if background is not None:
                with contextlib.suppress(Exception):
                    background.join(self.timeout + 30.0)
            raise
        if background is not None:
            background.join(self.timeout + 30.0)

    def verify(self, model_dir: str, out: str) -> tuple[bool, list[str]]:
        """After a sync: does vLLM hold exactly the trainer's weights? Every training process gathers them
        with DeepSpeed itself (``TrainerSync.save_reference``, into ``out/v{version}``), and each has its
        engines write that checkpoint through vLLM's own loader maps: after an exact sync not one bit of any
        parameter changes. Collective over the training processes. Returns whether every process found its
        engines unchanged, and this process's changed parameter names. Slow next to a sync: for tests and
        first runs, not every step of a real job."""
        import torch.distributed as dist

        if self.trainer is None or self.rollout is None or not self.history:
            raise RuntimeError("verify() checks the last sync: attach(engine) and sync first")
        path = str(Path(out) / f"v{self.history[-1].version}")
        self.trainer.save_reference(model_dir, path)
        changed = self.rollout.changed_by(path)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, not changed)
        return all(every), changed

    def in_process_bytes(self, result: SyncResult) -> int:
        """Bytes ranks in this process copied straight from this rank's storages (handoffs, no message)."""
        return sum(result.stats.bytes_handed.values())

    def summary(self) -> dict[str, Any]:
        """Per-process figures: syncs, their seconds (median, each), the last sync's bytes sent over the process
        group, bytes handed to ranks in this process and bytes copied by same-host workers that map this
        process's storages (both copied in memory), its version; per sync, the bytes
        this process sent and, for delta syncs, the share of the elements it compared that had changed."""
        seconds = [r.seconds for r in self.history]
        last = self.history[-1] if self.history else None
        return {
            **self.setup,
            "syncs": len(self.history),
            "sync_s_median": round(statistics.median(seconds), 4) if seconds else None,
            "sync_s": [round(s, 4) for s in seconds],
            "bytes_sent": sum(last.stats.bytes_sent.values()) if last else 0,  # the last sync's
            "in_process_bytes": self.in_process_bytes(last) if last else 0,
            "mapped_bytes": sum(last.stats.bytes_mapped.values()) if last else 0,
            "version": last.version if last else None,
            "bytes_sent_per_sync": [sum(r.stats.bytes_sent.values()) for r in self.history],
            "changed_fraction": [changed_fraction(r) for r in self.history],
        }

    def detach(self) -> None:
        if self.trainer is not None:
            self.trainer.detach()
            self.trainer = None
