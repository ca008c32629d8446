"""vLLM side of rollout-sync, kept thin: a worker extension (``extension.RolloutSyncExtension``), a
weight-transfer backend for vLLM's own API (``weight_transfer``, registered by ``registration.register``
from the ``vllm.general_plugins`` entry point), how a worker learns vLLM's storage layout (``targets``: maps
from shapes checked by a meta-device trace of the loaders, ``tracing``, or the element probe, ``probing``),
derived-copy rebuilds (``derived``) and driver helpers for several engines (``driver``).
vLLM is imported lazily, inside functions, so importing this package does not import vLLM."""

EXTENSION = "vllm_plugin.extension.RolloutSyncExtension"

__all__ = ["EXTENSION"]
