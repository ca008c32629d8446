"""The baseline sync most DeepSpeed RL pipelines use today (OpenRLHF style), on the vLLM side, for the
``sync`` benchmark: one gloo group spans trainer rank 0 (group rank 0) and every vLLM worker; for each
parameter in turn, trainer rank 0 broadcasts the full tensor and each worker receives it into a fresh buffer
and hands it to ``model.load_weights``. At the end the derived copies are rebuilt the way our receive does.
On an engine with layers kept in another form (packed linear weights), ``load_weights`` alone cannot write
them: the baseline does what an RL framework must do there, vLLM's ``initialize_layerwise_reload`` before
the loads and ``finalize_layerwise_reload`` after them.

``BenchExtension`` is ``RolloutSyncExtension`` plus the baseline's two methods and a receive of ours wrapped
in the same peak-memory measurement (``testbed.peak_memory``), so that both methods are measured
alike inside the worker. The baseline's methods are not named ``rollout_sync_*``: they are what an RL
framework's own worker extension does, so vLLM's engine core waits for their replies as stock vLLM does
(spinning for a second after its previous read), not idle as it does for rollout-sync's calls
(``vllm_plugin.quiet_wait``). Start the engine with
``worker_extension_cls="testbed.baseline_extension.BenchExtension"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rollout_sync.errors import IncompleteUpdateError
from testbed.peak_memory import PeakMemory
from vllm_plugin.extension import RolloutSyncExtension

__all__ = ["BenchExtension"]

_DTYPES = ("bfloat16", "float16", "float32")


class BenchExtension(RolloutSyncExtension):
    openrlhf_baseline_group: Any = None

    def openrlhf_baseline_connect(
        self, host: str, port: int, world_size: int, first_rank: int, timeout: float = 300.0
    ) -> int:
        """Join the baseline's group as rank ``first_rank + tp_rank``; returns that rank."""
        from vllm.distributed.parallel_state import get_tp_group

        from rollout_sync.transport.core.groups import connect_store, new_group

        rank = first_rank + get_tp_group().rank_in_group
        store = connect_store(host, port, world_size, is_master=False, timeout=timeout)
        self.openrlhf_baseline_group = new_group(
            store, rank, world_size, timeout=timeout, prefix="rollout-sync-baseline"
        )
        return rank

    def openrlhf_baseline_receive(self, tensors: Sequence[tuple[str, Sequence[int], str]]) -> dict[str, Any]:
        """Receive every ``(name, shape, dtype)`` from group rank 0 in order and load it through vLLM's own
        ``load_weights``; then rebuild derived copies. Returns seconds, received bytes and peak extra RSS."""
        import torch
        import torch.distributed as dist

        group = self.openrlhf_baseline_group
        if group is None:
            raise IncompleteUpdateError("openrlhf_baseline_connect has not run on this worker")
        worker = self.rollout_sync_get()
        model = self.model_runner.model  # type: ignore[attr-defined]
        reload = worker.loaded_forms is not None
        memory = PeakMemory().start()
        start = time.perf_counter()
        received = 0
        if reload:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(model)
        for name, shape, dtype in tensors:
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: dtype {dtype!r} is not one of {_DTYPES}")
            buf = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            group.broadcast([buf], opts).wait()
            with torch.no_grad():
                model.load_weights([(name, buf)])
            received += buf.numel() * buf.element_size()
            del buf
        if reload:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        refreshed = []
        for copy in worker.derived:
            copy.refresh()
            refreshed.append(copy.name)
        seconds = time.perf_counter() - start
        return {
            "rank": worker.rank,
            "seconds": seconds,
            "bytes_received": received,
            "extra_bytes": memory.stop(),
            "memory_method": memory.method,
            "refreshed": refreshed,
        }

    def rollout_sync_bench_pack(self, stand_in: bool) -> dict[str, int]:
        """How many dense linear layers vLLM packed (empty weight); with ``stand_in``, pack the others with
        ``testbed.packing`` (on CPUs where vLLM keeps plain weights)."""
        from testbed.packing import dense_linears, pack_linears

        model = self.model_runner.model  # type: ignore[attr-defined]
        linears = dense_linears(model)
        by_vllm = sum(1 for _, m in linears if int(m.weight.numel()) == 0)
        stood_in = pack_linears(model) if stand_in else 0
        return {"linears": len(linears), "packed_by_vllm": by_vllm, "packed_by_stand_in": stood_in}

    def rollout_sync_bench_receive(self) -> dict[str, Any]:
        """``rollout_sync_receive`` (ours: receive the half, refresh derived copies) with peak extra RSS."""
        memory = PeakMemory().start()
        report = self.rollout_sync_receive()
        return {**report, "extra_bytes": memory.stop(), "memory_method": memory.method}

    def rollout_sync_bench_setup(self, first_rank: int, maps: str) -> dict[str, Any]:
        """``rollout_sync_setup`` with its peak extra RSS and wall time in this worker, and the targets it
        found (``rollout_sync.rollout.codec`` form), for the ``setup`` benchmark."""
        memory = PeakMemory().start()
        start = time.perf_counter()
        summary = self.rollout_sync_setup(first_rank=first_rank, maps=maps)
        seconds = time.perf_counter() - start
        return {
            "summary": summary,
            "seconds": seconds,
            "extra_bytes": memory.stop(),
            "memory_method": memory.method,
            "targets": self.rollout_sync_local_targets(),
        }
