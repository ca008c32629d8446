"""Entry point of the ``vllm.general_plugins`` group (declared in ``pyproject.toml``): registers the
``rollout_sync`` weight-transfer backend with vLLM (worker side here; the trainer side,
``vllm_plugin.trainer_engine``, registers itself when imported, and here too), so that ``weight_transfer_config={"backend":
"rollout_sync"}`` (``--weight-transfer-config '{"backend": "rollout_sync"}'``) selects it, and makes the
engine core wait idle for its workers' replies to rollout-sync's calls (``quiet_wait``) and gives it the
forgets its prefix cache at every new weight version, also while requests are in flight (``prefix_cache``).

vLLM loads general plugins in every process (driver, engine core, workers), possibly several times per
process: registration is idempotent. The engine module is imported lazily, only where an engine is
created.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "rollout_sync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm_plugin import trainer_engine as vllm_trainer  # noqa: F401  # registers the trainer-side engine

    from . import prefix_cache, quiet_wait

    quiet_wait.install()
    prefix_cache.install()

    registry = getattr(WeightTransferEngineFactory, "_registry", {})
    if BACKEND in registry:
        return
    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "vllm_plugin.weight_transfer", "RolloutSyncWeightTransferEngine"
        )
    except ValueError:  # registered meanwhile (vLLM raises on duplicates)
        if BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
            raise
