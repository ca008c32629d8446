"""Real DeepSpeed training engines on CPU ranks (gloo), built from a tiny checkpoint, for tests.

``run_deepspeed(spec, model_path, check, world_size, *args)`` spawns ``world_size`` ranks with
``run_on_ranks``; each rank initialises DeepSpeed's default process group (gloo), loads the checkpoint,
builds the engine described by ``spec`` (ZeRO stage, AutoTP size, AutoEP size, bf16 or fp32) and returns
``check(rank_ctx, *args)``. ``check`` must be a module-level function (ranks are spawned) and return
something that pickles. ``rank_ctx`` is a ``DeepSpeedRank``: the engine, the rank, the world size, the
``run_on_ranks`` group (a gloo group not registered with ``torch.distributed``) and the spec.

The engine-building parts (``DeepSpeedSpec``, ``build_engine``, ...) live in ``testbed.deepspeed``
(the example and the benchmarks use them too) and are re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.deepspeed import (
    DeepSpeedSpec,
    build_engine,
    checkpoint_mismatches,
    full_parameters,
    skip_shm_build_unless_asked,
    train_step,
)

__all__ = [
    "DeepSpeedRank",
    "DeepSpeedSpec",
    "build_engine",
    "checkpoint_mismatches",
    "full_parameters",
    "init_deepspeed_distributed",
    "run_deepspeed",
    "train_step",
]
from tests.harness.ranks import run_on_ranks


@dataclass
class DeepSpeedRank:
    """What a check function receives inside one rank."""

    rank: int
    world_size: int
    group: Any
    spec: DeepSpeedSpec
    model_path: Path
    engine: Any
    #: Seconds from entering the rank to a ready engine (includes imports and process-group set-up).
    startup_s: float


def _agree_on_port(rank: int, group: Any) -> int:
    """Rank 0 picks a free TCP port for DeepSpeed's default group and broadcasts it over ``group``."""
    import socket

    import torch
    import torch.distributed as dist

    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port[0] = sock.getsockname()[1]
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([port], opts).wait()
    return int(port.item())


def init_deepspeed_distributed(rank: int, world_size: int, group: Any) -> None:
    """Initialise DeepSpeed's default (gloo) process group in a ``run_on_ranks`` rank."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = _agree_on_port(rank, group)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    skip_shm_build_unless_asked()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def _ds_rank_main(
    rank: int,
    world_size: int,
    group: Any,
    spec: DeepSpeedSpec,
    model_path: str,
    check: Callable[..., Any],
    args: tuple[Any, ...],
) -> Any:
    import time

    started = time.perf_counter()
    init_deepspeed_distributed(rank, world_size, group)
    engine = build_engine(spec, model_path)
    ctx = DeepSpeedRank(
        rank=rank,
        world_size=world_size,
        group=group,
        spec=spec,
        model_path=Path(model_path),
        engine=engine,
        startup_s=time.perf_counter() - started,
    )
    return check(ctx, *args)


def run_deepspeed(
    spec: DeepSpeedSpec,
    model_path: str | os.PathLike[str],
    check: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
) -> list[Any]:
    """Build the engine of ``spec`` on ``world_size`` CPU ranks and return ``check(rank_ctx, *args)`` of
    each rank, in rank order. Raises what a rank raised (see ``run_on_ranks``)."""
    if world_size % spec.autotp_size or world_size % spec.autoep_size:
        raise ValueError(
            f"world size {world_size} must be a multiple of autotp_size {spec.autotp_size} and "
            f"of autoep_size {spec.autoep_size}"
        )
    return run_on_ranks(_ds_rank_main, world_size, spec, str(model_path), check, args, timeout=timeout)
