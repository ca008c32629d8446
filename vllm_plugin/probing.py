"""Learn where vLLM stores each element of each logical tensor by running vLLM's own loaders on probes.

For each logical tensor and each of its dimensions ``d``, the model's ``load_weights`` receives a
zero-memory probe ``arange(1, n_d + 1)`` broadcast along ``d`` (``expand``, no copy), while the
parameters' ``.data`` are temporarily swapped for float tensors filled with ``-1``. Whatever element of a
parameter no longer holds ``-1`` was written by the loader, and its value is the logical coordinate (+1)
along ``d``. Index 0 is never a probe value, because vocab loaders zero-fill padding rows. The
observations (``rollout_sync.rollout.probe.Landing``) are turned into maps by pure code.

Memory: only the parameters of the probed tensor's layer (the outermost integer segment of its name, as
vLLM's ``layerwise_groups`` uses) get real probe buffers; every other parameter gets a zero-memory tripwire
(a one-element tensor expanded to its shape, which raises on a copy into it), so a loader that writes outside the expected scope raises
and the tensor is probed again with every parameter given a probe buffer. Parameters and persistent
buffers are restored afterwards, whatever happens.

Nothing here moves real weights: the probe never touches the parameters' real storage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rollout_sync.rollout.probe import Landing

__all__ = ["ProbeResult", "probe_model", "stack_key"]

_EMPTY = -1.0


@dataclass
class ProbeResult:
    """Observations of one worker: ``landings[name]`` (one per parameter written), ``errors[name]`` (the
    loader raised, or its observations were inconsistent between probes), ``dtypes[name]`` (the real dtype
    of the parameter the tensor lands in), and the seconds spent."""

    landings: dict[str, list[Landing]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def stack_key(name: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the outermost integer segment of a dotted name, or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Swap:
    """Holds the real ``.data`` of every parameter and swaps probe buffers or tripwires in and out."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], probe_dtype: torch.dtype) -> None:
        self.params = params
        self.real = {name: p.data for name, p in params.items()}
        self.probe_dtype = probe_dtype
        self.buffers: dict[str, torch.Tensor] = {}

    def scope(self, names: Sequence[str]) -> None:
        """Probe buffers for ``names``, tripwires for every other parameter."""
        wanted = set(names)
        for name, p in self.params.items():
            real = self.real[name]
            if name in wanted:
                buf = self.buffers.get(name)
                if buf is None:
                    buf = torch.full(real.shape, _EMPTY, dtype=self.probe_dtype, device=real.device)
                    self.buffers[name] = buf
                else:
                    buf.fill_(_EMPTY)
                p.data = buf
            else:
                p.data = torch.empty((), dtype=self.probe_dtype, device=real.device).expand(real.shape)
        for name in list(self.buffers):
            if name not in wanted:
                del self.buffers[name]

    def reset(self) -> None:
        """Every probe buffer back to -1 (after a loader failed half-way)."""
        for buf in self.buffers.values():
            buf.fill_(_EMPTY)

    def restore(self) -> None:
        for name, p in self.params.items():
            p.data = self.real[name]
        self.buffers.clear()


@contextmanager
def _restored_buffers(model: torch.nn.Module) -> Iterator[None]:
    """Persistent buffers a loader might write (kv-cache scales, batch-norm statistics) are copied back."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        current = dict(model.named_buffers())
        with torch.no_grad():
            for name, value in saved.items():
                buf = current.get(name)
                if buf is not None and buf.shape == value.shape and buf.dtype == value.dtype:
                    buf.copy_(value)


def _probe_tensor(shape: tuple[int, ...], dim: int, dtype: torch.dtype) -> torch.Tensor:
    if not shape:
        return torch.ones((), dtype=dtype)
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return torch.arange(1, shape[dim] + 1, dtype=dtype).view(view).expand(shape)


def _observe(swap: _Swap, names: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(positions, values) of every written element of the probed parameters; resets them to -1."""
    seen = {}
    for name in names:
        buf = swap.buffers[name]
        flat = buf.view(-1)
        written = (flat != _EMPTY).nonzero().view(-1)
        if written.numel():
            seen[name] = (written.cpu().numpy().astype(np.int64), flat[written].double().cpu().numpy())
            flat[written] = _EMPTY
    return seen


def _probe_one(
    model: Any,
    swap: _Swap,
    scope: Sequence[str],
    tensor: str,
    shape: tuple[int, ...],
) -> list[Landing]:
    """Probe one tensor along each dimension within ``scope``; raise on any inconsistency."""
    per_dim: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
    for dim in range(max(len(shape), 1)):
        model.load_weights([(tensor, _probe_tensor(shape, dim, swap.probe_dtype))])
        per_dim.append(_observe(swap, scope))
    first = per_dim[0]
    for dim, seen in enumerate(per_dim[1:], start=1):
        if seen.keys() != first.keys() or any(not np.array_equal(seen[p][0], first[p][0]) for p in first):
            raise ValueError(
                f"probing dimension {dim} wrote other elements than probing dimension 0: the loader's "
                "placement depends on the values (it transforms them)"
            )
    landings = []
    for param, (positions, _) in first.items():
        values = (
            np.stack([seen[param][1] for seen in per_dim], axis=1) if shape else np.ones((len(positions), 0))
        )
        real = swap.real[param]
        landings.append(
            Landing(
                param=param,
                param_shape=tuple(real.shape),
                param_contiguous=real.is_contiguous(),
                positions=positions,
                values=values,
            )
        )
    return landings


def probe_model(model: Any, tensors: Mapping[str, tuple[int, ...]]) -> ProbeResult:
    """Run the loader probe for every logical tensor ``name -> shape`` on ``model`` (a vLLM model with
    ``load_weights``). The model's parameters and buffers are unchanged afterwards."""
    import time

    started = time.perf_counter()
    params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
    biggest = max((max(s) for s in tensors.values() if s), default=1)
    probe_dtype = torch.float32 if biggest < 2**24 else torch.float64
    result = ProbeResult()
    by_key: dict[tuple[str, int] | None, list[str]] = {}
    for name in tensors:
        by_key.setdefault(stack_key(name), []).append(name)
    params_by_key: dict[tuple[str, int] | None, list[str]] = {}
    for pname in params:
        params_by_key.setdefault(stack_key(pname), []).append(pname)
    everything = list(params)
    swap = _Swap(params, probe_dtype)
    with torch.no_grad(), _restored_buffers(model):
        try:
            for key, names in by_key.items():
                scope = params_by_key.get(key, [])
                swap.scope(scope)
                retry: list[str] = []
                for name in names:
                    try:
                        landings = _probe_one(model, swap, scope, name, tensors[name])
                    except Exception:  # a write outside the scope trips a tripwire, or the loader fails
                        swap.reset()
                        retry.append(name)
                        continue
                    if landings:
                        result.landings[name] = landings
                    else:
                        retry.append(name)
                if retry:
                    swap.scope(everything)
                    for name in retry:
                        try:
                            landings = _probe_one(model, swap, everything, name, tensors[name])
                        except Exception as exc:
                            swap.reset()
                            result.errors[name] = f"{type(exc).__name__}: {exc}"
                            continue
                        if landings:
                            result.landings[name] = landings
        finally:
            swap.restore()
    for name, landings in result.landings.items():
        result.dtypes[name] = _dtype_name(params[landings[0].param].dtype)
    result.seconds = time.perf_counter() - started
    return result
