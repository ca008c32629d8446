"""Where a live DeepSpeed 0.19.8 engine keeps what the trainer adapter reads, found locally (no collective):
a process group's global ranks, a module's AutoEP layers, whether a parameter is a ZeRO-3 partition, and a
parameter's full (unpartitioned) shape.

Shared by the refusal checks (``checks``), the placement reader (``placements``) and the
recovery of ZeRO positions (``zero_positions``). DeepSpeed is imported only when a function needs it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["autoep_layers", "full_param_shape", "group_ranks", "is_zero3_param"]


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group, in group order."""
    return tuple(int(r) for r in tdist.get_process_group_ranks(group))


def autoep_layers(module: torch.nn.Module) -> dict[str, Any]:
    """AutoEP's MoE layers of ``module`` by module name (none without AutoEP)."""
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:
        return {}
    return {name: m for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)}


def is_zero3_param(p: Any) -> bool:
    """Whether ZeRO-3 partitions ``p`` (it has a ``ds_tensor``)."""
    return getattr(p, "ds_tensor", None) is not None


def full_param_shape(p: Any) -> tuple[int, ...]:
    """The parameter's own shape (ZeRO-3's ``ds_shape`` for a partitioned one)."""
    return tuple(int(s) for s in (p.ds_shape if is_zero3_param(p) else p.shape))
