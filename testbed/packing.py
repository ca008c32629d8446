"""A stand-in for the weight packing vLLM does on AVX-512/AMX CPUs, for tests and the sync benchmark on CPUs
where vLLM keeps plain weights (AVX2).

On AVX-512/AMX CPUs vLLM's ``UnquantizedLinearMethod.process_weights_after_loading`` runs the CPU GEMM
dispatch: it builds a oneDNN handle or an sgl-packed copy of the weight, keeps it in the layer's
``cpu_linear`` closure and replaces ``layer.weight`` by an empty parameter. ``pack_linears`` puts a quant
method on every dense linear layer that does the same with a plain kernel (the packed form is a K-major copy
read back transposed) and runs it now, as vLLM does at load; vLLM's reload runs it again after each
rebuild. The product meets the same kind of layer through the same code path; only the kernel differs.
Runs inside a vLLM worker (it imports vLLM).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dense_linears", "pack_linears"]


def dense_linears(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Every dense linear layer of a vLLM model (``LinearBase``), by module name."""
    from vllm.model_executor.layers.linear import LinearBase

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]


def _stand_in_packing() -> Any:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class StandInPacking(UnquantizedLinearMethod):
        def process_weights_after_loading(self, layer: Any) -> None:
            weight = layer.weight
            packed = weight.detach().t().contiguous()
            layer.cpu_linear = lambda x, _w, bias: torch.nn.functional.linear(x, packed.t(), bias)
            layer.weight = torch.nn.Parameter(
                torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False
            )

    return StandInPacking()


def pack_linears(model: torch.nn.Module) -> int:
    """Pack every dense linear layer that still keeps its weight; returns how many were packed."""
    packed = 0
    for _, module in dense_linears(model):
        if module.weight.numel() == 0:
            continue
        module.quant_method = _stand_in_packing()
        module.quant_method.process_weights_after_loading(module)
        packed += 1
    return packed
