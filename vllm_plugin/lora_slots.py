"""An adapter's home in a vLLM worker: a LoRA slot held for it, the boxes of A and B this worker stores
(read from vLLM's own slicing), checked against vLLM's own ``set_lora``, and the copies into the slot.

``AdapterSpec`` is what the driver names (``setup_engines(..., lora=...)``): the adapter's vLLM name and id,
its rank, its scaling (PEFT's ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) and which base modules it
adapts (PEFT's ``target_modules``: module names or their last part). ``AdapterSlot.hold`` registers a
zero adapter of that rank under the id with vLLM's LoRA manager and pins it in a slot (an adapter vLLM
itself activated, as a request naming it would; pinned, it is never evicted, so requests naming it find
it in that slot and nothing is read from a path). Each sync then writes A and B into that slot
(``rollout_sync.rollout.lora_maps``).

Swapping without downtime (writing a second slot while requests use the first, then switching names) is
not built: the sync writes the held slot in place, between engine steps like any weight sync, and a request
running across it sees the new adapter from its next step on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout_sync.errors import TargetMismatchError, UnsupportedLayoutError
from rollout_sync.layout.box import Box
from rollout_sync.layout.dtypes import dtype_name
from rollout_sync.rollout.local_targets import LocalTargets
from rollout_sync.rollout.lora_maps import LoraSlice, StagedSlice, slice_targets, slot_a_name
from rollout_sync.rollout.update import DerivedCopy

__all__ = ["AdapterSlot", "AdapterSpec"]


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter a sync keeps servable: vLLM's ``LoRARequest(name, lora_id, ...)`` names it."""

    name: str
    lora_id: int
    rank: int
    scaling: float
    target_modules: tuple[str, ...] | None = None

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> AdapterSpec:
        known = {"name", "lora_id", "rank", "scaling", "target_modules"}
        if set(data) - known or not {"name", "lora_id", "rank", "scaling"} <= set(data):
            raise UnsupportedLayoutError(
                "a malformed adapter spec", expected=sorted(known), found=sorted(data)
            )
        modules = data.get("target_modules")
        spec = AdapterSpec(
            str(data["name"]),
            int(data["lora_id"]),
            int(data["rank"]),
            float(data["scaling"]),
            None if modules is None else tuple(str(m) for m in modules),
        )
        if spec.lora_id < 1 or spec.rank < 1 or not math.isfinite(spec.scaling):
            raise UnsupportedLayoutError(
                "an adapter spec needs lora_id >= 1, rank >= 1 and a finite scaling", found=data
            )
        return spec

    def adapts(self, module: str) -> bool:
        if self.target_modules is None:
            return True
        last = module.rsplit(".", 1)[-1]
        return module in self.target_modules or last in self.target_modules


def _worker_manager(model_runner: Any) -> Any:
    manager = getattr(model_runner, "lora_manager", None)
    if manager is None:
        raise UnsupportedLayoutError(
            "an adapter sync needs an engine with LoRA",
            expected="LLM(..., enable_lora=True, max_lora_rank=R, max_loras=N)",
            found="enable_lora off",
        )
    return manager


def _box(tensor: str, got: torch.Tensor, shape: tuple[int, int]) -> Box:
    """The box of a ``[rows, cols]`` index tensor (``arange`` over ``shape``) that a slicing returned."""
    cols = shape[1]
    if got.dim() != 2 or got.numel() == 0:
        raise UnsupportedLayoutError(
            "vLLM's LoRA slicing returned no 2-D box", tensor=tensor, found=got.shape
        )
    first = int(got.reshape(-1)[0])
    origin = (first // cols, first % cols)
    rows = torch.arange(origin[0], origin[0] + got.shape[0], dtype=torch.int64).view(-1, 1)
    want = rows * cols + torch.arange(origin[1], origin[1] + got.shape[1], dtype=torch.int64).view(1, -1)
    if not torch.equal(got, want):
        raise UnsupportedLayoutError(
            "vLLM's LoRA slicing of this tensor is not one box", tensor=tensor, found=tuple(got.shape)
        )
    return Box(origin, (int(got.shape[0]), int(got.shape[1])))


def _sliced(layer: Any, a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """What vLLM's ``set_lora`` writes for full ``a`` and ``b`` (one per slice), before the slot copy."""
    packed = int(layer.n_slices) > 1
    got_a: Any = a if packed else a[0]
    got_b: Any = b if packed else b[0]
    if int(getattr(layer, "tp_size", 1)) > 1:
        got_a, got_b = layer.slice_lora_a(got_a), layer.slice_lora_b(got_b)
    return (list(got_a), list(got_b)) if packed else ([got_a], [got_b])


def _layer_slices(
    name: str, layer: Any, modules: Sequence[str], shapes: Mapping[str, tuple[int, ...]], rank: int
) -> list[LoraSlice]:
    full_a, full_b = [], []
    for module in modules:
        base = shapes.get(f"{module}.weight")
        if base is None or len(base) != 2:
            raise UnsupportedLayoutError(
                "an adapted module without a 2-D base weight in the checkpoint",
                tensor=f"{module}.weight",
                found=base,
            )
        full_a.append((rank, int(base[1])))
        full_b.append((int(base[0]), rank))
    index_a = [torch.arange(r * c, dtype=torch.int64).view(r, c) for r, c in full_a]
    index_b = [torch.arange(r * c, dtype=torch.int64).view(r, c) for r, c in full_b]
    got_a, got_b = _sliced(layer, index_a, index_b)
    out = []
    for i, module in enumerate(modules):
        out.append(
            LoraSlice(
                module,
                name,
                i,
                full_a[i],
                full_b[i],
                _box(f"{module}.lora_A.weight", got_a[i], full_a[i]),
                _box(f"{module}.lora_B.weight", got_b[i], full_b[i]),
                tuple(int(x) for x in layer.lora_a_stacked[i].shape),  # type: ignore[arg-type]
                tuple(int(x) for x in layer.lora_b_stacked[i].shape),  # type: ignore[arg-type]
            )
        )
    return out


def _check_against_set_lora(layer: Any, slices: Sequence[LoraSlice], slot: int) -> None:
    """Load index probes (value = logical linear index + 1, float32) through vLLM's own ``set_lora`` into
    stand-in slot buffers and compare with what the slices say: every written element, and nothing else."""
    real = (layer.lora_a_stacked, layer.lora_b_stacked)
    stand_a = tuple(torch.zeros(t.shape, dtype=torch.float32) for t in real[0])
    stand_b = tuple(torch.zeros(t.shape, dtype=torch.float32) for t in real[1])
    probe_a = [
        torch.arange(1, s.a_shape[0] * s.a_shape[1] + 1, dtype=torch.float32).view(s.a_shape) for s in slices
    ]
    probe_b = [
        torch.arange(1, s.b_shape[0] * s.b_shape[1] + 1, dtype=torch.float32).view(s.b_shape) for s in slices
    ]
    packed = int(layer.n_slices) > 1
    layer.lora_a_stacked, layer.lora_b_stacked = stand_a, stand_b
    try:
        with torch.no_grad():
            layer.set_lora(slot, probe_a if packed else probe_a[0], probe_b if packed else probe_b[0])
    finally:
        layer.lora_a_stacked, layer.lora_b_stacked = real
    for s in slices:
        for which, stand, probe, box in (("A", stand_a, probe_a, s.a_box), ("B", stand_b, probe_b, s.b_box)):
            rows, cols = box.extent
            want = torch.zeros(stand[s.index].shape[2:], dtype=torch.float32)
            want[:rows, :cols] = probe[s.index][
                box.origin[0] : box.origin[0] + rows, box.origin[1] : box.origin[1] + cols
            ]
            if not torch.equal(stand[s.index][slot, 0], want):
                raise TargetMismatchError(
                    "vLLM's set_lora writes this adapter tensor elsewhere than its slice's box says",
                    tensor=f"{s.module}.lora_{which}.weight",
                    box=box,
                )


def _copy_into_slot(
    layer: Any, staged: Sequence[StagedSlice], tensors: Mapping[str, torch.Tensor], slot: int
) -> Any:
    def refresh() -> None:
        with torch.no_grad():
            for s in staged:
                stacked = layer.lora_a_stacked if s.which == "a" else layer.lora_b_stacked
                rows, cols = s.shape
                region = stacked[s.index][slot, 0, :rows, :cols]
                region.copy_(tensors[s.name])
                if s.scaling != 1:
                    region *= s.scaling  # as vLLM's LoRALayerWeights.optimize, in the LoRA dtype

    return refresh


@dataclass
class AdapterSlot:
    """The slot held for one adapter on one worker: its target maps, the storages they name (slot buffers
    and staging tensors, by storage name) and the copies into the slot after a sync."""

    spec: AdapterSpec
    slot: int
    targets: LocalTargets
    storages: dict[str, torch.Tensor]
    derived: list[DerivedCopy]

    @classmethod
    def hold(
        cls, model_runner: Any, spec: AdapterSpec, shapes: Mapping[str, tuple[int, ...]], *, rank: int
    ) -> AdapterSlot:
        worker_manager = _worker_manager(model_runner)
        manager = worker_manager._adapter_manager
        config = manager.lora_config
        if spec.rank > int(config.max_lora_rank):
            raise UnsupportedLayoutError(
                f"the adapter {spec.name!r} has a rank above the engine's max_lora_rank",
                expected=f"rank <= {config.max_lora_rank} (or start the engine with max_lora_rank >= {spec.rank})",
                found=spec.rank,
            )
        layers: dict[str, tuple[Any, list[str]]] = {}
        for name, layer in manager.modules.items():
            if not isinstance(getattr(layer, "n_slices", None), int) or not hasattr(layer, "lora_a_stacked"):
                continue  # a LoRA embedding or head (not a linear layer's slot)
            last = name.rsplit(".", 1)[-1]
            parts = manager.packed_modules_mapping.get(last, [last]) if int(layer.n_slices) > 1 else [last]
            prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
            modules = [prefix + p for p in parts]
            if len(modules) != int(layer.n_slices):
                continue
            chosen = [spec.adapts(m) for m in modules]
            if any(chosen):
                if not all(chosen):
                    raise UnsupportedLayoutError(
                        "an adapter on only some slices of a layer vLLM packs",
                        tensor=name,
                        expected=modules,
                        found=[m for m, c in zip(modules, chosen, strict=True) if c],
                    )
                layers[name] = (layer, modules)
        if spec.target_modules is not None:
            served = {m for _, ms in layers.values() for m in ms}
            for target in spec.target_modules:
                if not any(m == target or m.endswith("." + target) for m in served):
                    raise UnsupportedLayoutError(
                        "a target module this engine does not serve as LoRA",
                        tensor=target,
                        expected=sorted({m.rsplit(".", 1)[-1] for _, ms in layers.values() for m in ms}),
                        found=target,
                    )
        if not layers:
            raise UnsupportedLayoutError("the engine serves no LoRA layer this adapter adapts", found=spec)
        slot = _pin(worker_manager, manager, spec)
        slices: list[LoraSlice] = []
        per_layer: dict[str, list[LoraSlice]] = {}
        for name, (layer, modules) in layers.items():
            got = _layer_slices(name, layer, modules, shapes, spec.rank)
            _check_against_set_lora(layer, got, slot)
            per_layer[name] = got
            slices += got
        dtype = dtype_name(next(iter(layers.values()))[0].lora_a_stacked[0].dtype)
        targets, staged = slice_targets(slices, rank=rank, slot=slot, dtype=dtype, scaling=spec.scaling)
        storages: dict[str, torch.Tensor] = {}
        derived = []
        for name, (layer, _) in layers.items():
            for i in range(int(layer.n_slices)):
                storages[slot_a_name(name, i)] = layer.lora_a_stacked[i]
            mine = [s for s in staged if s.layer == name]
            for s in mine:
                like = layer.lora_a_stacked[s.index] if s.which == "a" else layer.lora_b_stacked[s.index]
                storages[s.name] = torch.zeros(s.shape, dtype=like.dtype, device=like.device)
            derived.append(
                DerivedCopy(
                    f"LoRA slot {slot} of {name}",
                    frozenset(s.name for s in mine),
                    _copy_into_slot(layer, mine, storages, slot),
                    False,
                )
            )
        return cls(spec, slot, targets, storages, derived)


def _pin(worker_manager: Any, manager: Any, spec: AdapterSpec) -> int:
    """Register a zero adapter of ``spec.rank`` under ``spec.lora_id`` and pin it in a slot."""
    if spec.lora_id not in manager.list_adapters():
        dummy = manager.create_dummy_lora(spec.lora_id, spec.rank, worker_manager.embedding_modules)
        manager.add_adapter(dummy)
    manager.pin_adapter(spec.lora_id)
    return int(manager.lora_index_to_id.index(spec.lora_id))
