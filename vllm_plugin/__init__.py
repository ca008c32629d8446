"""vLLM side of rollout-sync, kept thin: a worker extension (``extension.RolloutSyncExtension``), a
weight-transfer backend for vLLM's own API (``weight_transfer``, registered by ``registration.register``
from the ``vllm.general_plugins`` entry point), how a worker learns vLLM's storage layout (``targets``: maps
from shapes checked by a meta-device trace of the loaders, ``tracing``, or the element probe, ``probing``),
derived-copy rebuilds (``derived``), joining the group and receiving inside a worker (``worker_link``) and
driver helpers for several engines (``driver``, ``http_driver``).

The rule for the rollout side: what touches vLLM's objects or runs inside vLLM's processes is here; what
needs no vLLM (vLLM's storage geometry, target maps, writes into storage views, the link to the sync group)
is in ``rollout_sync.rollout``. vLLM is imported lazily, inside functions, so importing this package does
not import vLLM; nothing here imports DeepSpeed (a vLLM host installs ``rollout-sync[rollout]`` only)."""

EXTENSION = "vllm_plugin.extension.RolloutSyncExtension"

__all__ = ["EXTENSION"]
