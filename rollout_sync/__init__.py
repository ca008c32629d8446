"""rollout-sync: move freshly trained DeepSpeed weights into running vLLM engines, directly from where the
trainer stores each element to where vLLM stores it, with a plan computed once and reused at every step.

Where a thing lives (one rule per folder):

- ``layout/``: pure geometry of boxes, pieces, maps and runs; knows no framework.
- ``shapes/``: shape tables of real models, composed with each side's geometry into whole-model maps.
- ``planning/``: pure; maps to a plan of segments, its digest and its wire form.
- ``transport/``: executing a rank's half of a plan over a process group, with bounded staging.
- ``handshake/``: the ZeroMQ messages that exchange maps and hand out plan halves.
- ``sync/``: what both sides run at each sync: the endpoint, the coordinator's work, the commit, the roster.
- ``trainer/``: the DeepSpeed side: DeepSpeed's storage geometry, reading a live engine, the trainer hook.
- ``rollout/``: the vLLM side that needs no vLLM: vLLM's storage geometry, target maps, the link to the
  sync group, writes into storage views. What runs inside vLLM's processes and touches vLLM's objects is
  the separate ``vllm_plugin`` package (the only code that imports vLLM).
- ``integrations/``: TRL and transformers' ``Trainer``.
- ``scale/``: the shape-only dry run behind ``rollout-sync plan``.
- ``interop/``: conversion to DeepSpeed's affine IR.
- ``tiny``: tiny Qwen3 checkpoints made locally, to try it without a download (``python -m rollout_sync.tiny``).
The benchmarks live in the checkout's top-level ``benchmarks/`` (``python -m benchmarks``; ``bench/`` here
only forwards its old name); neither they nor ``testbed/`` (what tests and benchmarks share) are
installed, and no product module imports them.

DeepSpeed is imported only on the trainer side, and only when an engine is read: a vLLM host installs the
package without it (extra ``[rollout]``; the trainer installs ``[trainer]``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import LayoutError, PeerFailedError, RolloutSyncError, SyncTimeoutError

if TYPE_CHECKING:
    from vllm_plugin.async_driver import connect_engine_async, receive_sync_async, setup_engines_async
    from vllm_plugin.driver import connect_engine, receive_sync, setup_engines, verify_engine
    from vllm_plugin.http_driver import ServerEngine

    from .integrations.ray import attach_in_ray, connect_in_ray, release_in_ray
    from .integrations.trainer_callback import RolloutSyncCallback
    from .integrations.trl import use_rollout_sync
    from .sync.options import SyncOptions
    from .trainer.hook import TrainerSync

__version__ = "0.1.0"

# The public API: what the README and the examples import. Each side's names load their side's framework
# only when first used (``TrainerSync``: DeepSpeed; the drivers: vLLM), so importing the package stays light.
_LAZY = {
    "TrainerSync": "rollout_sync.trainer.hook",
    "SyncOptions": "rollout_sync.sync.options",
    "setup_engines": "vllm_plugin.driver",
    "connect_engine": "vllm_plugin.driver",
    "receive_sync": "vllm_plugin.driver",
    "setup_engines_async": "vllm_plugin.async_driver",
    "connect_engine_async": "vllm_plugin.async_driver",
    "receive_sync_async": "vllm_plugin.async_driver",
    "verify_engine": "vllm_plugin.driver",
    "ServerEngine": "vllm_plugin.http_driver",
    "use_rollout_sync": "rollout_sync.integrations.trl",
    "RolloutSyncCallback": "rollout_sync.integrations.trainer_callback",
    "attach_in_ray": "rollout_sync.integrations.ray",
    "connect_in_ray": "rollout_sync.integrations.ray",
    "release_in_ray": "rollout_sync.integrations.ray",
}
__all__ = [
    "LayoutError",
    "PeerFailedError",
    "RolloutSyncCallback",
    "RolloutSyncError",
    "ServerEngine",
    "SyncOptions",
    "SyncTimeoutError",
    "TrainerSync",
    "attach_in_ray",
    "connect_engine",
    "connect_engine_async",
    "connect_in_ray",
    "receive_sync",
    "receive_sync_async",
    "release_in_ray",
    "setup_engines",
    "setup_engines_async",
    "use_rollout_sync",
    "verify_engine",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
