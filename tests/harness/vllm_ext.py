"""A worker extension the harness loads into vLLM workers to look inside them (``worker_extension_cls=
"tests.harness.vllm_ext.HarnessWorkerExtension"``). vLLM refuses an extension whose attribute collides with
a worker attribute, so every name here starts with ``rs_harness_``. Runs in the spawned worker: the repo
root must be on ``PYTHONPATH`` (``vllm_engines`` puts it there)."""

from __future__ import annotations

import os
from typing import Any

HARNESS_EXTENSION = "tests.harness.vllm_ext.HarnessWorkerExtension"


class HarnessWorkerExtension:
    model_runner: Any

    def rs_harness_ranks(self) -> dict[str, int]:
        """This worker's TP rank and size, engine-global rank and process id."""
        from vllm.distributed.parallel_state import get_tp_group, get_world_group

        tp = get_tp_group()
        return {
            "tp_rank": tp.rank_in_group,
            "tp_size": tp.world_size,
            "world_rank": get_world_group().rank,
            "pid": os.getpid(),
        }

    def rs_harness_param_shapes(self) -> dict[str, list[int]]:
        """Shape of every parameter of the worker's model, by vLLM's parameter name (lists: tuples in
        an RPC result come back as lists through vLLM's serialization)."""
        model = self.model_runner.model
        return {name: list(p.shape) for name, p in model.named_parameters()}
