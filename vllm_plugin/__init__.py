"""Everything of rollout-sync that runs in or drives vLLM, kept thin: the worker extension
(``extension.RolloutSyncExtension``), how a worker learns vLLM's storage layout (``worker_maps``: maps from
shapes checked by a meta-device trace of the loaders, ``tracing``, or the element probe, ``probing``), layers
kept in another form (``loaded_form``, ``layer_memory``), LoRA slots (``lora_slots``), derived-copy rebuilds
(``derived``), joining the group and receiving inside a worker (``worker_link``), the weight-transfer
backend for vLLM's own API (``weight_transfer``, registered by ``registration.register`` from the
``vllm.general_plugins`` entry point) and its trainer-side engine (``trainer_engine``); the drivers: offline
(``driver``), ``AsyncLLM`` (``async_driver``), HTTP (``http_driver``), the engines as a training process sees
them (``rollouts``), and the ``vllm serve`` launcher (``serve``).
The rule for the rollout side: what touches vLLM's objects, runs inside vLLM's processes or drives vLLM is
here; what needs no vLLM (target maps, writes into storage views, the link to the sync group, the delta
base) is in ``rollout_sync.rollout``. vLLM is imported lazily, inside functions, so importing this package
does not import vLLM; nothing here imports DeepSpeed at import time (a vLLM host installs
``rollout-sync[rollout]`` only)."""

EXTENSION = "vllm_plugin.extension.RolloutSyncExtension"

__all__ = ["EXTENSION"]
