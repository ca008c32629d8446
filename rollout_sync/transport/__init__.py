"""Moving bytes: every rank executes its half of a plan over one process group spanning trainer and
rollout ranks (gloo on CPUs, NCCL on GPUs), with bounded staging, an agreement before anything moves, and
bounded waits.

``schedule`` and ``fingerprint`` are pure; ``executor`` runs them (``Executor.execute`` / ``execute``);
``groups`` builds the cross-process group.
"""

from .executor import Executor, execute
from .groups import build_group, group_backend, group_rank, group_size, new_group
from .stats import DEFAULT_STAGING_CAP_BYTES, ExecuteOptions, SyncStats

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
