"""Merged syncs of a PEFT LoRA model: the engine (without LoRA) gets ``W + s·B·A`` in its base weights, and no
rank gathers a base weight.

Each trainer rank computes the merged values of the base-weight storage it already holds (its ZeRO-3
partition, its ZeRO-0/1/2 replica) from that storage and the adapter's small A and B (gathered per module
under ZeRO-3, collectively, in module order), into a buffer of the storage's shape that the sync sends from:
per piece of the storage (a box of ``W``), ``W_box + delta[box]`` with ``delta = ((B.float() @ A.float()) *
s).to(B.dtype)``: the arithmetic and order of PEFT's ``LoraLayer.get_delta_weight`` on CPU (bf16/fp16 cast
to fp32 for the product, scaled, cast back), then ``merge``'s ``weight += delta`` (``merge_and_unload``).

The product is computed whole, of the same shape as PEFT's: torch's CPU GEMM gives a row other bits alone
than as part of the whole product (measured: one row of ``B @ A`` computed alone, the first or last row of
a ZeRO-3 partition, differs in the last fp32 bit; ``tests/unit/test_lora_merged.py`` catches it in fp32),
so a rank that multiplied only the rows it stores would not match PEFT bit for bit. Equality also assumes the GEMM gives the same bits
in the trainer process as where PEFT's merge runs (the same library and thread count).

Memory: the merged buffers are kept between syncs, one per adapted base weight this rank stores (this rank's
share of the adapted base weights, ``MergedSources.bytes``), and while a module is merged its gathered A and
B and its whole delta (6 bytes per element of the weight: fp32 product, bf16 delta); no base weight is
gathered.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import LayoutError
from ..layout.maps import TensorMap
from .adapter import AdapterConfig

__all__ = ["MergedSources", "merged_storage", "merged_tensor_name"]

_BASE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.base_layer\.(?P<leaf>weight|bias)$")


def merged_tensor_name(param: str) -> str | None:
    """The checkpoint name of a PEFT model's parameter in a merged sync, or None for the adapter's own
    (``lora_A``/``lora_B``/...)."""
    if ".lora_" in param:
        return None
    m = _BASE.match(param)
    if m is not None:
        return f"{m['module']}.{m['leaf']}"
    return param.removeprefix("base_model.model.")


def merged_storage(
    maps: Sequence[TensorMap], sources: Mapping[str, torch.Tensor]
) -> tuple[list[TensorMap], dict[str, torch.Tensor]]:
    """The base model's maps and views under checkpoint names (the adapter's own left out)."""
    out, views = [], {}
    for m in maps:
        name = merged_tensor_name(m.name)
        if name is not None:
            out.append(replace(m, name=name))
            if m.name in sources:
                views[name] = sources[m.name]
    return out, views


@dataclass
class _Adapted:
    name: str  # the base weight's checkpoint name
    a: Any  # the trainer's lora_A parameter [r, in]
    b: Any  # lora_B [out, r]
    pieces: tuple[Any, ...]  # this rank's pieces of the weight (map pieces: box, offset, strides)
    merged: torch.Tensor  # of this rank's storage shape and dtype


def _gathered(params: Sequence[Any]) -> Any:
    import contextlib

    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params))
    return contextlib.nullcontext()


class MergedSources:
    """The merged buffers of one trainer rank, refreshed before each sync (``refresh``)."""

    def __init__(
        self,
        module: Any,
        maps: Sequence[TensorMap],
        sources: Mapping[str, torch.Tensor],
        config: AdapterConfig,
        rank: int,
    ) -> None:
        self.scaling = config.scaling
        self.scratch: dict[str, torch.Tensor] = {}  # the product and the delta of the module being merged
        params = dict(module.named_parameters())
        by_name = {m.name: m for m in maps}
        self.adapted: list[_Adapted] = []
        prefix = "base_model.model."
        for pname in params:
            m = _BASE.match(pname)
            if m is None or m["leaf"] != "weight":
                continue
            base = f"{prefix}{m['module']}" if pname.startswith(prefix) else m["module"]
            a = params.get(f"{base}.lora_A.{config.adapter}.weight")
            b = params.get(f"{base}.lora_B.{config.adapter}.weight")
            if a is None or b is None:
                continue
            name = f"{m['module']}.weight"
            tmap = by_name.get(name)
            if tmap is None:
                raise LayoutError("an adapted base weight without a map", tensor=name, rank=rank)
            storage = tmap.ranks.get(rank)
            view = sources.get(name)
            if storage is None or view is None:
                merged = torch.empty(0)
                pieces: tuple[Any, ...] = ()
            else:
                merged = torch.empty_like(view)
                pieces = storage.pieces
            self.adapted.append(_Adapted(name, a, b, pieces, merged))

    def _scratch(self, what: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """A buffer for ``what`` of ``shape``, cut from one kept for the largest module merged so far."""
        n = shape[0] * shape[1]
        buf = self.scratch.get(what)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self.scratch[what] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)

    @property
    def bytes(self) -> int:
        """Bytes this rank keeps between syncs: the merged buffers and the scratch of the largest module."""
        kept = [x.merged for x in self.adapted] + list(self.scratch.values())
        return sum(t.numel() * t.element_size() for t in kept)

    def refresh(self, sources: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's sources with every adapted base weight's storage replaced by its merged values.
        Collective under ZeRO-3 (A and B are gathered module by module, on every trainer rank)."""
        out = dict(sources)
        with torch.no_grad():
            for x in self.adapted:
                with _gathered([x.a, x.b]):
                    if not x.pieces:
                        continue
                    view = sources[x.name]
                    a, b = x.a.data, x.b.data
                    # PEFT's get_delta_weight: bf16/fp16 adapters on CPU multiply in fp32, cast back to B's dtype
                    fp32 = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
                    # the whole product, as PEFT computes it (see the module doc), into buffers kept between
                    # syncs (fresh ones would fault their pages in at every sync)
                    shape = (b.shape[0], a.shape[1])
                    product = self._scratch("product", torch.float32 if fp32 else b.dtype, shape)
                    torch.matmul(b.float() if fp32 else b, a.float() if fp32 else a, out=product)
                    product.mul_(self.scaling)
                    delta_full = product
                    if fp32:
                        delta_full = self._scratch("delta", b.dtype, shape)
                        delta_full.copy_(product)
                    for p in x.pieces:
                        (r0, c0), (rows, cols) = p.box.origin, p.box.extent
                        delta = delta_full[r0 : r0 + rows, c0 : c0 + cols]
                        base = torch.as_strided(
                            view, p.box.extent, p.strides, view.storage_offset() + p.offset
                        )
                        dst = torch.as_strided(
                            x.merged, p.box.extent, p.strides, x.merged.storage_offset() + p.offset
                        )
                        torch.add(base, delta, out=dst)  # merge's ``weight += delta``
                out[x.name] = x.merged
        return out
