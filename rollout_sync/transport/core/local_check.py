"""Local checks before the agreement: does this rank hold every storage its half needs, with the plan's
shape and dtype, contiguous, on one device, and do no target and source storages share memory? A target
given as a meta tensor (streamed: made while it is written) is checked for shape and dtype only. Returns the
reason for a refusal (a string every rank will see) rather than raising, so that a rank that cannot run
still joins the agreement and every rank stops together."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...layout.dtypes import dtype_name
from ...planning.half import PlanHalf

__all__ = ["check_storages"]


def _needed(half: PlanHalf) -> tuple[set[int], set[int]]:
    """Indices of tensors whose source storage, and whose target storage, this rank's half touches."""
    sources = {s.tensor for s in half.sends} | {s.tensor for s in half.local}
    targets = {s.tensor for s in half.receives} | {s.tensor for s in half.local}
    return sources, targets


def check_storages(
    half: PlanHalf, sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
) -> tuple[str | None, torch.device | None]:
    """(reason to refuse or None, the device of the storages or None when the half needs none)."""
    rank = half.rank
    need_src, need_tgt = _needed(half)
    devices: dict[torch.device, str] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {"source": [], "target": []}
    for side, needed, given in (("source", need_src, sources), ("target", need_tgt, targets)):
        for i in sorted(needed):
            t = half.tensors[i]
            shape = (t.source_storage if side == "source" else t.target_storage).get(rank)
            dtype = t.source_dtype if side == "source" else t.target_dtype
            storage = given.get(t.name)
            if storage is None:
                return f"no {side} storage for tensor {t.name!r} on rank {rank}", None
            if not isinstance(storage, torch.Tensor):
                return f"the {side} storage of tensor {t.name!r} on rank {rank} is not a tensor", None
            if shape is None or tuple(storage.shape) != tuple(shape):
                return (
                    f"{side} storage of tensor {t.name!r} on rank {rank}: expected shape "
                    f"{None if shape is None else tuple(shape)}, found {tuple(storage.shape)}"
                ), None
            if dtype_name(storage.dtype) != dtype:
                return (
                    f"{side} storage of tensor {t.name!r} on rank {rank}: expected dtype {dtype}, "
                    f"found {dtype_name(storage.dtype)}"
                ), None
            if not storage.is_contiguous():
                return f"{side} storage of tensor {t.name!r} on rank {rank} is not contiguous", None
            if storage.is_meta:  # a streamed target: made during the transfer (checked then)
                continue
            devices.setdefault(storage.device, t.name)
            if storage.numel():
                start = storage.data_ptr()
                spans[side].append((start, start + storage.numel() * storage.element_size(), t.name))
    if len(devices) > 1:
        found = ", ".join(f"{d} ({name!r})" for d, name in devices.items())
        return f"the storages of rank {rank} are on several devices: {found}", None
    # A target that shares memory with a source would be overwritten while it may still be read.
    events = sorted(
        [(a, b, n, "source") for a, b, n in spans["source"]]
        + [(a, b, n, "target") for a, b, n in spans["target"]]
    )
    reach: dict[str, tuple[int, str]] = {}
    for start, stop, name, side in events:
        other = "target" if side == "source" else "source"
        if other in reach and reach[other][0] > start:
            first = reach[other][1]
            return (
                f"on rank {rank} the {side} storage of tensor {name!r} shares memory with the {other} storage "
                f"of tensor {first!r} (in-place resharding is not supported)"
            ), None
        if side not in reach or stop > reach[side][0]:
            reach[side] = (stop, name)
    device = next(iter(devices)) if devices else None
    return None, device
