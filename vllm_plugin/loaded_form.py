"""Layers whose stored form is not their loaded form, and how a sync rebuilds them through vLLM's reload
machinery (``vllm/model_executor/model_loader/reload/``).

Some kernels keep a layer's weights in another form than the loader wrote: vLLM on AVX-512/AMX CPUs packs
every dense linear weight into a oneDNN or sgl handle and leaves an empty ``weight``; on GPUs, online FP8
quantization, Marlin and other repacks do the same kind of thing in ``process_weights_after_loading``.
vLLM records every module's *loaded form* (parameters as ``create_weights`` made them, on the meta device,
with their weight loaders) when the model is built (``record_metadata_for_reloading``). A layer is
**transformed** when its parameters now differ from that record (a name, shape or dtype).

For such a layer the target maps describe the loaded form: setup restores it on the meta device and the
loader probe runs against it (``probing``); at a sync the layer is materialized (``open``: empty loaded-form
tensors, elements no logical tensor fills zeroed, as vLLM's loaders leave padding), the executor writes
into it, and as soon as every tensor of the layer has landed ``close`` runs vLLM's per-layer post-load step:
the layer's ``quant_method.process_weights_after_loading`` rebuilds the kernel's form, the result is copied
into the kernel's original tensors (so CUDA graphs keep their addresses) and the loaded form is freed.
Nothing here depends on the platform: the same steps serve a CPU-packed linear and an FP8 layer on a GPU.

vLLM's public entry points (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``) are not used
as such: they restore *every* module of the model to the meta device at once (so the storage of layers we
write in place would be detached from the model during the update) and buffer the full tensors handed to
``load_weights`` until a layer's element count is reached. A sync writes boxes straight into storage and
never calls a loader, so this module calls the per-layer steps those functions are made of
(``restore_layer_on_meta``, ``materialize_layer``, ``_layerwise_process``, ``_place_kernel_tensors``) on
the transformed layers only.

**Kept loaded forms** (``keep``, for delta syncs): a delta sync writes only the elements that changed, so
it needs the values the last sync wrote, which a streamed loaded form no longer holds (vLLM's processing
consumed it; a packed or quantized form cannot in general be turned back into it). With ``keep(True)``
every layer's loaded form lives on between syncs (allocated at the first update that writes it, zeros where
no logical tensor lands), the executor writes into it like any storage, and when a layer is complete it is
materialized, the kept loaded form is copied into it and vLLM's processing rebuilds the kernel's form. The
first such rebuild of a layer also checks that its processing left that copy bit for bit as it was (vLLM's CPU
packing reads its input; some GPU repacks shuffle theirs in place); where it did, later rebuilds hand the kept
tensors themselves to processing, without the copy (``lends_kept``; 0.07-0.1 s per TP-2 worker of Qwen3-0.6B
shapes on a 2-core AMX CPU). The cost is the memory of every transformed layer's loaded form
(``kept_bytes``); ``keep(False)`` frees it.

A layer that cannot be rebuilt is refused at setup, naming it and the reason: no recorded loaded form, no
``quant_method`` to run, or a loaded-form parameter no logical tensor fills (its processing would read
elements the plan never delivers).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollout_sync.errors import UnsupportedLayoutError
from rollout_sync.rollout.apply import covered_ranges, uncovered_ranges
from rollout_sync.rollout.storage_view import StorageView
from rollout_sync.rollout.update import REBUILD_ROOM
from rollout_sync.transport.delta.change_codec import bits_dtype

from .layer_memory import LayerMemory

__all__ = ["LoadedForms", "transformed_layers"]


def _reload() -> Any:
    from vllm.model_executor.model_loader.reload import layerwise

    return layerwise


def _differs(layer: torch.nn.Module, recorded: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``layer``'s parameters are not its recorded loaded form, or None when they are."""
    current = {n: p for n, p in layer._parameters.items() if p is not None}
    for name, meta in recorded.items():
        now = current.get(name)
        if now is None:
            return f"parameter {name!r} is gone"
        if tuple(now.shape) != tuple(meta.shape) or now.dtype != meta.dtype:
            return (
                f"parameter {name!r} is {tuple(now.shape)} {now.dtype}, loaded form "
                f"{tuple(meta.shape)} {meta.dtype}"
            )
    return None


def transformed_layers(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> why its stored form differs from its recorded loaded form."""
    layerwise = _reload()
    out: dict[str, str] = {}
    for name, layer in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        why = _differs(layer, info.restore_metadata[0])
        if why is not None:
            out[name] = why
    return out


def _drop_kernel_state(module: torch.nn.Module) -> None:
    """Let go of a kernel's form that lives outside the layer's parameters before the rebuild makes the new
    one, so that the two never coexist. vLLM's CPU GEMM dispatch keeps a packed linear weight (or a oneDNN
    handle) in the closure ``cpu_linear``; the rebuild sets a new one (until then the layer holds its loaded
    form, and no forward runs during an update). A kernel's form kept in the layer's own parameters (FP8,
    Marlin on GPUs) is not touched: vLLM copies the rebuilt form into those tensors in place."""
    if callable(getattr(module, "cpu_linear", None)):
        setattr(module, "cpu_linear", torch.nn.functional.linear)  # noqa: B010 - not a tensor attribute


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():  # bit patterns: a NaN equals itself, -0.0 differs from 0.0
        a, b = a.view(bits_dtype(a.element_size())), b.view(bits_dtype(b.element_size()))
    return bool(torch.equal(a, b))


@dataclass
class _Layer:
    name: str
    module: torch.nn.Module
    params: tuple[str, ...]  # full names of its loaded-form parameters


class LoadedForms:
    """The transformed layers of one worker's model and their rebuild, one layer at a time."""

    def __init__(self, model: torch.nn.Module, layers: Mapping[str, str]) -> None:
        layerwise = _reload()
        self.model = model
        self.reasons = dict(layers)
        self.layers: dict[str, _Layer] = {}
        modules = dict(model.named_modules())
        for name in layers:
            module = modules[name]
            recorded = layerwise.LAYERWISE_INFO[module].restore_metadata[0]
            prefix = f"{name}." if name else ""
            self.layers[name] = _Layer(name, module, tuple(prefix + p for p in recorded))
        self.by_param = {p: layer.name for layer in self.layers.values() for p in layer.params}
        self.zero: dict[str, list[tuple[int, int]]] = {}
        self._bytes: dict[str, int] = {}
        self.open_layers: dict[str, dict[str, torch.Tensor]] = {}
        self.keeping = False
        self.kept: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its loaded form, kept between syncs
        # layer -> whether its processing was seen to leave its inputs untouched, so that the kept loaded form
        # itself is handed to it (no copy); checked at its first rebuild from a kept form
        self.lends_kept: dict[str, bool] = {}
        self.memory = LayerMemory()  # where loaded forms live while open (pooled buffers)
        self.seconds = {"open": 0.0, "rebuild": 0.0}  # since the last ``reset_seconds``
        self.rebuilt = 0
        self.lent = 0  # rebuilds handed a kept loaded form itself (``lends_kept``)
        self.unchanged = 0  # kept layers closed without a rebuild (nothing in them changed)
        self.peak_open = 0  # most layers open at once since the last ``reset_seconds``
        self.peak_held_bytes = 0  # most memory the loaded forms held at once, since then

    def reset_seconds(self) -> None:
        """Before an update: its counters from zero (and buffers of the last one taken back)."""
        self.seconds = {"open": 0.0, "rebuild": 0.0}
        self.rebuilt = 0
        self.lent = 0
        self.unchanged = 0
        self.peak_open = 0
        self.peak_held_bytes = 0
        if not self.open_layers:
            self.memory.settle(forget_busy=True)

    @classmethod
    def find(cls, model: torch.nn.Module) -> LoadedForms:
        return cls(model, transformed_layers(model))

    def __bool__(self) -> bool:
        return bool(self.layers)

    def layer_of(self, param: str | None) -> str | None:
        return None if param is None else self.by_param.get(param)

    def keep(self, on: bool) -> None:
        """Keep every layer's loaded form between syncs (``on``: a delta sync writes into them), or free the
        kept ones (``off``: each sync streams layers through memory). Not while an update has layers open."""
        if self.open_layers:
            raise RuntimeError(
                f"cannot change how loaded forms are kept while {len(self.open_layers)} are open"
            )
        self.keeping = on
        if not on:
            self.kept.clear()

    def kept_layer(self, layer: str) -> bool:
        """Whether ``layer``'s loaded form is kept and holds what the last update wrote into it."""
        return self.keeping and layer in self.kept

    @property
    def kept_bytes(self) -> int:
        """The memory the kept loaded forms take."""
        return sum(t.numel() * t.element_size() for ts in self.kept.values() for t in ts.values())

    def loaded_bytes(self, layer: str) -> int:
        """The memory ``layer``'s loaded form takes while it is open."""
        size = self._bytes.get(layer)
        if size is None:
            layerwise = _reload()
            recorded = layerwise.LAYERWISE_INFO[self.layers[layer].module].restore_metadata[0]
            size = self._bytes[layer] = sum(t.numel() * t.element_size() for t in recorded.values())
        return size

    def _info(self, layer: str) -> Any:
        return _reload().LAYERWISE_INFO[self.layers[layer].module]

    def held_bytes(self) -> int:
        """The memory the loaded forms hold now (open ones, and buffers kept for the next layers)."""
        return self.memory.held_bytes

    def adds_bytes(self, layer: str) -> int:
        """The memory opening ``layer`` would allocate now (0 where kept buffers serve it)."""
        return self.memory.adds_bytes(layer, self._info(layer))

    def room_bytes(self) -> int:
        """Beside the staging slots: the buffers the loaded forms keep with one layer open (one per distinct
        size of their tensors) and ``REBUILD_ROOM`` times the largest loaded form, for what a rebuild
        allocates (``UpdateSession.reserve_bytes``)."""
        sizes = {size for layer in self.layers for size in self.memory.sizes(layer, self._info(layer))}
        largest = max((self.loaded_bytes(layer) for layer in self.layers), default=0)
        return sum(n for n, _ in sizes) + REBUILD_ROOM * largest

    # ---------------------------------------------------------------------------------------- setup

    def _to_loaded_form(self, layer: _Layer) -> None:
        layerwise = _reload()
        info = layerwise.get_layerwise_info(layer.module)
        info.kernel_tensors = layerwise.get_layer_params_buffers(layer.module)
        info.kernel_non_persistent_buffers = set(layer.module._non_persistent_buffers_set)
        layerwise.restore_layer_on_meta(layer.module, info)

    def _to_kernel_form(self, layer: _Layer) -> None:
        layerwise = _reload()
        info = layerwise.get_layerwise_info(layer.module)
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer.module, info)
        info.reset()

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """Every transformed layer in its loaded form on the meta device (no memory), with its loaders,
        for the loader probe; the kernel's tensors are back afterwards, whatever happens."""
        done: list[_Layer] = []
        try:
            for layer in self.layers.values():
                self._to_loaded_form(layer)
                done.append(layer)
            yield
        finally:
            for layer in done:
                self._to_kernel_form(layer)

    def bind(self, views: Mapping[str, StorageView]) -> None:
        """Check every transformed layer the views write into can be rebuilt from what the plan delivers,
        and keep the ranges no view covers (zeroed at each sync). Layers no view writes are dropped: a
        sync never touches them."""
        layerwise = _reload()
        written = {self.by_param[v.param] for v in views.values() if v.param in self.by_param}
        for name in list(self.layers):
            if name not in written:
                del self.layers[name]
        self.by_param = {p: layer.name for layer in self.layers.values() for p in layer.params}
        all_views = list(views.values())
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        for layer in self.layers.values():
            quant_method = getattr(layer.module, "quant_method", None)
            if not isinstance(quant_method, QuantizeMethodBase):
                raise UnsupportedLayoutError(
                    "a layer kept in another form than its loaded form has no quant method whose "
                    "process_weights_after_loading could rebuild it",
                    tensor=layer.name,
                    expected="a layer with a vLLM quant method",
                    found=f"quant_method {type(quant_method).__name__}; {self.reasons.get(layer.name)}",
                )
            recorded = layerwise.LAYERWISE_INFO[layer.module].restore_metadata[0]
            for pname, meta in zip(layer.params, recorded.values(), strict=True):
                covered = covered_ranges(all_views, pname)
                if not covered:
                    raise UnsupportedLayoutError(
                        "no logical tensor fills this loaded-form parameter of a layer that is rebuilt "
                        "after each sync, so its processing would read elements the plan never delivers",
                        tensor=layer.name,
                        expected=f"a logical tensor landing in {pname!r}",
                        found="none",
                    )
                self.zero[pname] = uncovered_ranges(meta.numel(), covered)

    # ----------------------------------------------------------------------------------------- sync

    def open(self, name: str) -> Mapping[str, torch.Tensor]:
        """Materialize layer ``name``'s loaded form (uncovered elements zeroed): full parameter name ->
        tensor to write into. When loaded forms are kept: the kept one (made now, zeros, if there is none)."""
        opened = self.open_layers.get(name)
        if opened is not None:
            return opened
        if self.keeping:
            opened = self.open_layers[name] = self._kept(name)
            return opened
        layerwise = _reload()
        started = time.perf_counter()
        layer = self.layers[name]
        self._to_loaded_form(layer)
        info = layerwise.get_layerwise_info(layer.module)
        try:
            self.memory.materialize(name, layer.module, info)
        except BaseException:
            self._to_kernel_form(layer)
            self.memory.release(name)
            raise
        prefix = f"{name}." if name else ""
        tensors = {p: getattr(layer.module, p.removeprefix(prefix)) for p in layer.params}
        with torch.no_grad():
            for pname, t in tensors.items():
                flat = t.data.view(-1)
                for start, stop in self.zero.get(pname, ()):
                    flat[start:stop].zero_()
        opened = {p: t.data for p, t in tensors.items()}
        self.open_layers[name] = opened
        self.peak_open = max(self.peak_open, len(self.open_layers))
        self.peak_held_bytes = max(self.peak_held_bytes, self.memory.held_bytes)
        self.seconds["open"] += time.perf_counter() - started
        return opened

    def close(self, name: str) -> None:
        """Every element of layer ``name`` has landed: run vLLM's post-load processing of the layer, copy
        the result into the kernel's tensors, free the loaded form."""
        layerwise = _reload()
        started = time.perf_counter()
        layer = self.layers[name]
        opened = self.open_layers.pop(name)
        if self.keeping:  # still in its kernel's form: its loaded form is made from the kept one below
            self._to_loaded_form(layer)
        info = layerwise.get_layerwise_info(layer.module)
        # where the kept form is copied at a layer's first rebuild: the copies processing reads, to check after
        inputs: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                if self.keeping:
                    self.memory.materialize(name, layer.module, info)
                    prefix = f"{name}." if name else ""
                    lends = self.lends_kept.get(name)
                    self.lent += bool(lends)
                    for pname, kept in opened.items():
                        param = getattr(layer.module, pname.removeprefix(prefix))
                        if lends:
                            param.data = kept
                            continue
                        param.data.copy_(kept)
                        if lends is None:
                            inputs[pname] = param.data
                _drop_kernel_state(layer.module)
                layerwise._layerwise_process(layer.module, info)
                if inputs:  # did processing leave its inputs as they were? Then it may read the kept form
                    self.lends_kept[name] = all(_same_bits(inputs[p], opened[p]) for p in inputs)
        except BaseException:
            self._to_kernel_form(layer)
            raise
        finally:
            del opened, inputs
            self.memory.release(name)
        self.seconds["rebuild"] += time.perf_counter() - started
        self.rebuilt += 1

    def close_unchanged(self, name: str) -> None:
        """Kept layer ``name`` arrived and none of its elements changed (a delta sync): its kernel's form
        was made from these very values at the last update and stays; the layer is only closed."""
        if not self.keeping:
            raise RuntimeError(f"layer {name!r} is streamed: it has no earlier values to keep")
        self.open_layers.pop(name)
        self.unchanged += 1

    def discard(self) -> list[str]:
        """Put the kernel's tensors back on every open layer, unprocessed (their old weights stay)."""
        names = list(self.open_layers)
        for name in names:
            self.open_layers.pop(name)
            if not self.keeping:  # a kept loaded form was written beside the layer, which never left its form
                self._to_kernel_form(self.layers[name])
            self.memory.release(name)
        return names

    def _kept(self, name: str) -> dict[str, torch.Tensor]:
        """Layer ``name``'s kept loaded form, made (zeros) at its first use."""
        kept = self.kept.get(name)
        if kept is None:
            layerwise = _reload()
            info = layerwise.LAYERWISE_INFO[self.layers[name].module]
            recorded = info.restore_metadata[0]
            with info.restore_device:
                kept = {
                    p: torch.zeros(meta.shape, dtype=meta.dtype)
                    for p, meta in zip(self.layers[name].params, recorded.values(), strict=True)
                }
            self.kept[name] = kept
        return kept
