"""Moving bytes: every rank executes its half of a plan over one process group spanning trainer and
rollout ranks (gloo on CPUs, NCCL on GPUs), with bounded staging, an agreement before anything moves, and
bounded waits.

``executor`` runs one sync (``Executor.execute`` / ``execute``): ``half_check`` and ``local_check``, then
``agreement`` (with ``fingerprint``), then the schedule (``messages`` cuts each pair stream into messages,
``schedule`` assigns rounds and staging slots, ``copies`` addresses parts in storage; all pure), compiled by
``program``, then the transfer: ``full_transfer`` (over ``p2p``, with ``handoff`` within a process and
``same_host`` / ``shared_memory`` / ``pulls`` within a host), or a delta sync (``delta``: ``delta_state``,
``delta_shadow``, ``delta_run``, ``delta_landing``, ``delta_codec``). ``groups`` builds the cross-process
group.
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
