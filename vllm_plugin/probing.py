"""Learn where vLLM stores each element of each logical tensor by running vLLM's own loaders on probes.

For each logical tensor and each of its dimensions ``d``, the model's ``load_weights`` receives a
zero-memory probe ``arange(1, n_d + 1)`` broadcast along ``d`` (``expand``, no copy), while the
parameters' ``.data`` are temporarily swapped for float tensors filled with ``-1``. Whatever element of a
parameter no longer holds ``-1`` was written by the loader, and its value is the logical coordinate (+1)
along ``d``. Index 0 is never a probe value, because vocab loaders zero-fill padding rows. The
observations (``rollout_sync.rollout.landings.Landing``: one logical linear index per element of the
parameter's written window, accumulated over the probed dimensions a chunk at a time by
``LandingBuilder``) are turned into maps by pure code, one tensor at a time, as soon as it is probed.

Memory: a probe buffer (4 bytes an element) per parameter of the probed tensor's layer, one landing (4
bytes an element of the tensor's window in its parameter) at a time, and chunk-sized temporaries: for
Qwen3-0.6B's 77.8M-element vocab shard at TP 2, about 0.7 GB at the peak (counted from the sizes, not
measured per worker). Only the parameters of the probed tensor's layer (the outermost integer segment of its name, as
vLLM's ``layerwise_groups`` uses) get real probe buffers; every other parameter gets a zero-memory tripwire
(a one-element tensor expanded to its shape, which raises on a copy into it), so a loader that writes outside the expected scope raises
and the tensor is probed again with every parameter given a probe buffer. Parameters and persistent
buffers are restored afterwards, whatever happens.

Nothing here moves real weights: the probe never touches the parameters' real storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_sync.errors import NotAffineError
from rollout_sync.layout.dtypes import dtype_name
from rollout_sync.rollout.landings import CHUNK, Landing, LandingBuilder

__all__ = ["Observation", "ProbeResult", "probe_model", "put_parameter", "stack_key", "stand_in"]

_EMPTY = -1.0


@dataclass(frozen=True)
class Observation:
    """What probing one logical tensor found on this worker: its ``landings`` (one per parameter written;
    none when it lands nowhere here), the real ``dtype`` of the parameter it lands in, or the ``error`` of
    a loader that raised or whose observations show it transforms values."""

    name: str
    shape: tuple[int, ...]
    landings: list[Landing]
    dtype: str | None
    error: str | None


@dataclass
class ProbeResult:
    """Summary of one worker's probe: tensors that landed, ``errors[name]``, and the seconds spent."""

    landed: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def stack_key(name: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the outermost integer segment of a dotted name, or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def stand_in(p: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """``data`` as a parameter of ``p``'s class with ``p``'s attributes (its weight loader), for a module
    slot whose parameter cannot take ``data`` through ``.data`` (another device, the meta device)."""
    out = data.as_subclass(type(p))
    out.__dict__.update(p.__dict__)
    return out


def put_parameter(model: torch.nn.Module, name: str, p: torch.nn.Parameter) -> None:
    """Put ``p`` in the module slot of parameter ``name`` (a dotted name of ``model.named_parameters()``)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = p


class _Swap:
    """Holds the real ``.data`` of every parameter and swaps probe buffers or tripwires in and out.

    A parameter on the meta device (a layer's loaded form restored for probing, ``loaded_form``) cannot
    take another device's data through ``.data``: its module gets a stand-in parameter object instead (the
    buffer, of the parameter's class, with its attributes: its weight loader), and the meta parameter is
    put back afterwards. Its probe buffers live on ``meta_device``."""

    def __init__(
        self,
        model: torch.nn.Module,
        params: Mapping[str, torch.nn.Parameter],
        probe_dtype: torch.dtype,
        meta_device: torch.device,
    ) -> None:
        self.model = model
        self.params = params
        self.real = {name: p.data for name, p in params.items()}
        self.probe_dtype = probe_dtype
        self.meta_device = meta_device
        self.buffers: dict[str, torch.Tensor] = {}

    def _device(self, real: torch.Tensor) -> torch.device:
        return self.meta_device if real.is_meta else real.device

    def _put(self, name: str, data: torch.Tensor) -> None:
        p = self.params[name]
        if not self.real[name].is_meta:
            p.data = data
            return
        put_parameter(self.model, name, p if data is self.real[name] else stand_in(p, data))

    def scope(self, names: Sequence[str]) -> None:
        """Probe buffers for ``names``, tripwires for every other parameter."""
        wanted = set(names)
        for name in self.params:
            real = self.real[name]
            device = self._device(real)
            if name in wanted:
                buf = self.buffers.get(name)
                if buf is None:
                    buf = torch.full(real.shape, _EMPTY, dtype=self.probe_dtype, device=device)
                    self.buffers[name] = buf
                else:
                    buf.fill_(_EMPTY)
                self._put(name, buf)
            else:
                self._put(name, torch.empty((), dtype=self.probe_dtype, device=device).expand(real.shape))
        for name in list(self.buffers):
            if name not in wanted:
                del self.buffers[name]

    def reset(self) -> None:
        """Every probe buffer back to -1 (after a loader failed half-way)."""
        for buf in self.buffers.values():
            buf.fill_(_EMPTY)

    def restore(self) -> None:
        for name in self.params:
            self._put(name, self.real[name])
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


def _written(flat: torch.Tensor) -> tuple[int, int, int]:
    """``(first, stop, count)`` of the elements of a flat probe buffer that a loader wrote (not -1), a
    chunk at a time; ``(0, 0, 0)`` when none."""
    first, stop, count = -1, 0, 0
    for lo in range(0, flat.numel(), CHUNK):
        hit = (flat[lo : lo + CHUNK] != _EMPTY).nonzero().view(-1)
        if hit.numel():
            if first < 0:
                first = lo + int(hit[0])
            stop = lo + int(hit[-1]) + 1
            count += hit.numel()
    return (first, stop, count) if first >= 0 else (0, 0, 0)


def _probe_one(
    model: Any,
    swap: _Swap,
    scope: Sequence[str],
    tensor: str,
    shape: tuple[int, ...],
    rank: int,
) -> list[Landing]:
    """Probe one tensor along each dimension within ``scope``; each probed parameter's written window is
    handed to a ``LandingBuilder`` a chunk at a time (which raises on values that are not coordinates, or
    on elements written for one dimension's probe and not another's), then reset to -1."""
    builders: dict[str, LandingBuilder] = {}
    for dim in range(max(len(shape), 1)):
        model.load_weights([(tensor, _probe_tensor(shape, dim, swap.probe_dtype))])
        for name in scope:
            flat = swap.buffers[name].view(-1)
            builder = builders.get(name)
            if builder is None:  # dimension 0 opens the parameter's window; a later one must write nothing
                first, stop, count = _written(flat)
                if not count:
                    continue
                if dim:
                    raise NotAffineError(
                        f"probing dimension {dim} wrote into a parameter that probing dimension 0 left "
                        "alone: the loader's placement depends on the values (it transforms them)",
                        tensor=tensor,
                        rank=rank,
                        found=f"{count} elements of parameter {name!r}",
                    )
                real = swap.real[name]
                builder = builders[name] = LandingBuilder(
                    tensor,
                    shape,
                    rank,
                    param=name,
                    param_shape=tuple(real.shape),
                    param_contiguous=real.is_contiguous(),
                    start=first,
                    stop=stop,
                )
            lo, hi = builder.start, builder.start + builder.linear.shape[0]
            for at in range(lo, hi, CHUNK):  # the builder checks the window's holes against dimension 0's
                builder.add(dim, at - lo, flat[at : min(at + CHUNK, hi)].cpu().numpy())
            builder.written_outside(dim, _written(flat[:lo])[2] + _written(flat[hi:])[2])
            builder.dimension_done(dim)
            flat.fill_(_EMPTY)
    return [builder.landing() for builder in builders.values()]


def probe_model(
    model: Any,
    tensors: Mapping[str, tuple[int, ...]],
    *,
    rank: int,
    observe: Callable[[Observation], None],
    meta_device: torch.device | None = None,
) -> ProbeResult:
    """Run the loader probe for every logical tensor ``name -> shape`` on ``model`` (a vLLM model with
    ``load_weights``), handing each tensor's ``Observation`` to ``observe`` as soon as it is made (so only
    one tensor's landings are alive at a time). The model's parameters and buffers are unchanged
    afterwards. Parameters on the meta device (loaded forms restored for probing) get their probe buffers
    on ``meta_device`` (default: the device of the first parameter that is not on meta, else CPU)."""
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
    if meta_device is None:
        real = next((p for p in params.values() if not p.is_meta), None)
        meta_device = real.device if real is not None else torch.device("cpu")
    swap = _Swap(model, params, probe_dtype, meta_device)

    def report(name: str, landings: list[Landing] | None, error: str | None) -> None:
        dtype = dtype_name(swap.real[landings[0].param].dtype) if landings else None  # not the probe dtype
        if error is not None:
            result.errors[name] = error
        elif landings:
            result.landed.append(name)
        observe(Observation(name, tuple(tensors[name]), landings or [], dtype, error))

    with torch.no_grad(), _restored_buffers(model):
        try:
            for key, names in by_key.items():
                scope = params_by_key.get(key, [])
                swap.scope(scope)
                retry: list[str] = []
                for name in names:
                    try:
                        landings = _probe_one(model, swap, scope, name, tensors[name], rank)
                    except Exception:  # a write outside the scope trips a tripwire, or the loader fails
                        swap.reset()
                        retry.append(name)
                        continue
                    if landings:
                        report(name, landings, None)
                    else:
                        retry.append(name)
                if retry:
                    swap.scope(everything)
                    for name in retry:
                        try:
                            landings = _probe_one(model, swap, everything, name, tensors[name], rank)
                        except Exception as exc:
                            swap.reset()
                            report(name, None, f"{type(exc).__name__}: {exc}")
                            continue
                        report(name, landings, None)
        finally:
            swap.restore()
    result.seconds = time.perf_counter() - started
    return result
