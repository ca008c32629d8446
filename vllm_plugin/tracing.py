"""Trace vLLM's loaders on the meta device: where each logical tensor's elements land, without storing one.

For each logical tensor the model's own ``load_weights`` receives a meta tensor of the tensor's shape, while
every parameter is swapped for a meta stand-in of its shape and dtype (the parameter's class and
attributes, so its weight loader runs unchanged; the module's parameter slot holds the stand-in, as
``probing._Swap`` does for loaded forms). A ``TorchDispatchMode`` sees every aten call the loader makes:
views of the input and of the parameters run on meta and keep their offsets and strides, and each
``copy_`` from the input into a parameter is recorded as a ``rollout_sync.rollout.check.TracedCopy``
instead of being run. Any other use of the input that makes a new tensor (arithmetic, a cast, a clone)
ends the tensor's trace with an error: the loader transforms values, which only the element probe
(``probing``) can follow. Nothing is allocated beyond the stand-ins' Python objects; real parameters and
buffers are never written (copies into a real tensor are not run).

Used by setup's fast path to confirm the target maps built from shapes (``check.check_targets``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rollout_sync.rollout.check import LoaderTrace, TracedCopy

from .probing import put_parameter, stand_in

__all__ = ["trace_loads"]


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _Transformed(Exception):
    """The loader made a new tensor from the input instead of copying views of it."""


class _Recorder(TorchDispatchMode):
    """Records the copies from the storage ``source`` (the logical tensor) into parameters (``params``:
    storage -> name); see the module docstring."""

    def __init__(self, params: Mapping[int, str], source: int) -> None:
        super().__init__()
        self.params = params
        self.source = source
        self.copies: list[TracedCopy] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dest, src = args[0], args[1]
            from_source = isinstance(src, torch.Tensor) and src.is_meta and _storage(src) == self.source
            param = self.params.get(_storage(dest)) if dest.is_meta else None
            if from_source:
                if param is None:
                    raise _Transformed("the loader copies the tensor into something other than a parameter")
                self.copies.append(
                    TracedCopy(
                        param,
                        tuple(dest.shape),
                        dest.storage_offset(),
                        tuple(dest.stride()),
                        src.storage_offset(),
                        tuple(src.expand(dest.shape).stride()),
                    )
                )
            return dest  # never run: the stand-ins are meta, real tensors are not written
        flat, _ = tree_flatten((args, kwargs))
        uses_source = any(
            isinstance(a, torch.Tensor) and a.is_meta and _storage(a) == self.source for a in flat
        )
        out = func(*args, **kwargs)
        if uses_source:
            results, _ = tree_flatten(out)
            for r in results:
                if isinstance(r, torch.Tensor) and not (r.is_meta and _storage(r) == self.source):
                    raise _Transformed(f"the loader computes {func} from the tensor before copying it")
        return out


@contextmanager
def _meta_parameters(model: torch.nn.Module) -> Iterator[dict[int, str]]:
    """Every parameter swapped for a meta stand-in (its class and attributes); storage -> name."""
    swapped: list[tuple[str, torch.nn.Parameter]] = []
    by_storage: dict[int, str] = {}
    try:
        for name, p in list(model.named_parameters()):
            if p.is_meta:
                by_storage[_storage(p)] = name
                continue
            meta = stand_in(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
            put_parameter(model, name, meta)
            swapped.append((name, p))
            by_storage[_storage(meta)] = name
        yield by_storage
    finally:
        for name, p in swapped:
            put_parameter(model, name, p)


def trace_loads(
    model: Any, tensors: Mapping[str, tuple[int, ...]], dtype: torch.dtype
) -> dict[str, LoaderTrace]:
    """Trace ``model.load_weights`` for every logical tensor ``name -> shape`` (handed over as ``dtype``).
    The model's parameters and buffers are unchanged afterwards."""
    out: dict[str, LoaderTrace] = {}
    with torch.no_grad(), _meta_parameters(model) as params:
        for name, shape in tensors.items():
            source = torch.empty(tuple(shape), dtype=dtype, device="meta")
            recorder = _Recorder(params, _storage(source))
            try:
                with recorder:
                    model.load_weights([(name, source)])
            except Exception as exc:  # the loader raised on meta, or transformed the tensor
                out[name] = LoaderTrace(name, (), f"{type(exc).__name__}: {exc}")
                continue
            out[name] = LoaderTrace(name, tuple(recorder.copies))
    return out
