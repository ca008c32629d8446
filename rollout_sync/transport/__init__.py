"""Moving bytes: every rank executes its half of a plan over one process group spanning trainer and
rollout ranks (gloo on CPUs, NCCL on GPUs), with bounded staging, an agreement before anything moves, and
bounded waits.

``executor`` runs one sync (``Executor.execute`` / ``execute``): the checks and the agreement, then the
schedule compiled into a program (all in ``core/``, the group path's parts), then the transfer:
``full_transfer`` (over ``core.p2p``, with handoffs within a process and ``same_host/`` within a host), or
a delta sync (``delta/``). ``nixl/`` holds the group-free reads. Folders import downward only:
``core`` ← ``same_host``, ``delta``, ``nixl`` ← ``full_transfer``, ``executor``.
"""

from .core.groups import build_group, group_backend, group_rank, group_size, new_group
from .core.stats import DEFAULT_STAGING_CAP_BYTES, ExecuteOptions, SyncStats
from .executor import Executor, execute

__all__ = [
    "DEFAULT_STAGING_CAP_BYTES",
    "ExecuteOptions",
    "Executor",
    "SyncStats",
    "build_group",
    "execute",
    "group_backend",
    "group_rank",
    "group_size",
    "new_group",
]
