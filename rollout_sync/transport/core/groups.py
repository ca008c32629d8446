"""The process group that spans trainer ranks and rollout ranks.

Both sides already have their own default world (DeepSpeed's, vLLM's), so the sync group is built
directly from a ``TCPStore`` and a backend object, and is not registered with ``torch.distributed``
(``shared/ENVIRONMENT.md``). The executor therefore uses only the group object's own API (``send``,
``recv``, ``allgather``, ``rank``, ``size``), which ``torch.distributed``'s default world group
(``torch.distributed.group.WORLD``) offers too.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from .network import GLOO_IFNAME_ENV, use_nccl_interface

__all__ = ["build_group", "connect_store", "group_backend", "group_rank", "group_size", "new_group"]


def group_rank(group: Any) -> int:
    return int(group.rank())


def group_size(group: Any) -> int:
    return int(group.size())


def group_backend(group: Any) -> str:
    """``"gloo"``, ``"nccl"``, ... for a backend object or a ``ProcessGroup``."""
    getter = getattr(group, "_get_backend_name", None)
    name = getter() if callable(getter) else group.name()
    return str(name).lower()


def connect_store(host: str, port: int, world_size: int, *, is_master: bool, timeout: float) -> Any:
    """A ``TCPStore`` at ``host:port``; the master serves it (``port`` 0 picks a free port: read
    ``store.port``)."""
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        world_size,
        is_master,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def new_group(
    store: Any,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    prefix: str = "rollout-sync",
    bind: str | None = None,
) -> Any:
    """A process group object over ``store`` (keys under ``prefix``, so several groups can share one
    store). The group keeps its store alive. ``bind``: the local address its connections use (``network``:
    this rank's route to the coordinator); gloo binds it unless ``GLOO_SOCKET_IFNAME`` is set, NCCL is
    pointed at its interface unless ``NCCL_SOCKET_IFNAME`` is set."""
    import torch.distributed as dist

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size} ranks")
    scoped = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        if bind is None or os.environ.get(GLOO_IFNAME_ENV):
            return dist.ProcessGroupGloo(scoped, rank, world_size, timedelta(seconds=timeout))
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timedelta(seconds=timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
        return dist.ProcessGroupGloo(scoped, rank, world_size, options)
    if backend == "nccl":
        if bind is not None:
            use_nccl_interface(bind)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(scoped, rank, world_size, options)
    raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")


def build_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    prefix: str = "rollout-sync",
) -> Any:
    """Rank ``rank`` of a new group of ``world_size`` processes that meet at ``host:port`` (rank 0 serves
    the store). Every rank calls it with the same host, port, world size, backend and prefix."""
    store = connect_store(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return new_group(store, rank, world_size, backend=backend, timeout=timeout, prefix=prefix)
