"""Where one LoRA adapter's A and B are stored in a vLLM worker's LoRA slot (pure: no vLLM, no torch).

Logical tensors of an adapter are named as PEFT saves them, without PEFT's ``base_model.model.`` prefix:
``{module}.lora_A.weight [r, in]`` and ``{module}.lora_B.weight [out, r]`` for each adapted base module
(``model.layers.0.self_attn.q_proj``), ``in`` and ``out`` those of the module's base weight.

vLLM keeps the adapters it serves in fixed slots of each LoRA layer (``lora_a_stacked[i]`` of shape
``[max_loras, 1, max_rank, in_local]``, ``lora_b_stacked[i]`` of ``[max_loras, 1, out_local, max_rank]``, one
``i`` per slice of a packed layer: q/k/v of ``qkv_proj``, gate/up of ``gate_up_proj``). Loading adapter
``A, B`` into slot ``s`` (vLLM's ``set_lora``) cuts this TP rank's box out of each (``slice_lora_a`` /
``slice_lora_b``), writes A's box at ``lora_a_stacked[i][s, 0, :rows, :cols]`` and B's box, scaled (vLLM
folds PEFT's ``lora_alpha / r`` into B in the LoRA dtype before it loads it), at ``lora_b_stacked[i][s, 0,
:rows, :cols]``.

So on each worker (``slice_targets``):

- **A** lands in place in its slot where its box fills whole rows of the slot (``cols == in_local``: the
  rows are one contiguous run of ``lora_a_stacked[i]``), else in a staging tensor of the box's shape;
- **B** lands in a staging tensor of its box's shape (``{layer}.lora_b.{i}``), copied into the slot and
  scaled there after the sync (``StagedSlice``): the slot holds ``B * scaling`` and pads each row to the
  engine's ``max_rank``, neither of which a copy can produce in place. B is small (``out x r``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import LayoutError, ShapeMismatchError, UnsupportedLayoutError
from ..layout.box import Box, row_major_strides
from ..layout.maps import Piece, RankStorage, TensorMap
from .local_targets import LocalTargets
from .storage_view import StorageView

__all__ = [
    "LoraSlice",
    "StagedSlice",
    "adapter_tensor_names",
    "slice_targets",
    "slot_a_name",
    "staged_name",
]


def adapter_tensor_names(module: str) -> tuple[str, str]:
    """The logical names of the A and B of the adapter of base module ``module``."""
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def slot_a_name(layer: str, index: int) -> str:
    """The storage name of a LoRA layer's ``lora_a_stacked[index]`` (all slots)."""
    return f"{layer}.lora_a_stacked.{index}"


def staged_name(layer: str, which: str, index: int) -> str:
    """The storage name of the staging tensor of slice ``index`` of ``which`` (``"a"``/``"b"``)."""
    return f"{layer}.lora_{which}.{index}"


@dataclass(frozen=True, slots=True)
class LoraSlice:
    """One slice of one vLLM LoRA layer on one worker, as probed from vLLM's own slicing.

    ``module``: the base module PEFT adapts (``model.layers.0.self_attn.k_proj``); ``layer``: the vLLM LoRA
    layer holding it (``model.layers.0.self_attn.qkv_proj``); ``index``: the slice in that layer.
    ``a_shape`` / ``b_shape``: the logical A ``[r, in]`` and B ``[out, r]``; ``a_box`` / ``b_box``: the boxes
    of them this worker stores. ``slot_a``: the shape of ``lora_a_stacked[index]``; ``slot_b``: of
    ``lora_b_stacked[index]`` (``[max_loras, 1, rows, cols]``)."""

    module: str
    layer: str
    index: int
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]
    a_box: Box
    b_box: Box
    slot_a: tuple[int, int, int, int]
    slot_b: tuple[int, int, int, int]

    def check(self, slot: int) -> None:
        """Refuse a slice whose boxes do not fit the slot buffers (a rank above the engine's
        ``max_lora_rank``, a slot beyond ``max_loras``)."""
        a_name, b_name = adapter_tensor_names(self.module)
        if not 0 <= slot < self.slot_a[0]:
            raise UnsupportedLayoutError(
                "no such LoRA slot", tensor=a_name, expected=f"0..{self.slot_a[0] - 1}", found=slot
            )
        for name, box, buffer in ((a_name, self.a_box, self.slot_a), (b_name, self.b_box, self.slot_b)):
            rows, cols = box.extent
            if rows > buffer[2] or cols > buffer[3]:
                raise UnsupportedLayoutError(
                    "the adapter's box does not fit the engine's LoRA slot (is its rank above the engine's "
                    "max_lora_rank?)",
                    tensor=name,
                    box=box,
                    expected=f"at most {buffer[2]} x {buffer[3]} (max_lora_rank / layer width)",
                    found=f"{rows} x {cols}",
                )

    @property
    def a_in_place(self) -> bool:
        """A's box is whole rows of its slot: one contiguous run of ``lora_a_stacked[index]``."""
        return self.a_box.extent[1] == self.slot_a[3]


@dataclass(frozen=True, slots=True)
class StagedSlice:
    """A staging tensor copied into slot ``slot`` after a sync: ``lora_{which}_stacked[index][slot, 0,
    :rows, :cols] = staged * scaling`` (``scaling`` 1 for A)."""

    layer: str
    index: int
    which: str
    name: str
    shape: tuple[int, int]
    scaling: float


def _single(name: str, shape: tuple[int, int], box: Box, dtype: str, rank: int) -> TensorMap:
    extent = box.extent
    if any(o < 0 or o + e > s for o, e, s in zip(box.origin, extent, shape, strict=True)):
        raise ShapeMismatchError(
            "a LoRA box outside its tensor", tensor=name, rank=rank, box=box, found=shape
        )
    piece = Piece(box, 0, row_major_strides(extent), (rank,))
    return TensorMap(name, shape, dtype, {rank: RankStorage(extent, (piece,))})


def slice_targets(
    slices: Iterable[LoraSlice], *, rank: int, slot: int, dtype: str, scaling: float
) -> tuple[LocalTargets, list[StagedSlice]]:
    """This worker's target maps of an adapter's A and B in LoRA slot ``slot`` (``dtype``: the engine's
    LoRA dtype), and the staging tensors to copy into the slot after each sync (B scaled by ``scaling``)."""
    maps: dict[str, TensorMap] = {}
    views: dict[str, StorageView] = {}
    staged: list[StagedSlice] = []
    for s in slices:
        s.check(slot)
        a_name, b_name = adapter_tensor_names(s.module)
        if a_name in maps:
            raise LayoutError("a module's adapter in two LoRA slices", tensor=a_name, rank=rank)
        maps[a_name] = _single(a_name, s.a_shape, s.a_box, dtype, rank)
        rows, cols = s.a_box.extent
        if s.a_in_place:
            per_slot = s.slot_a[1] * s.slot_a[2] * s.slot_a[3]
            views[a_name] = StorageView(slot_a_name(s.layer, s.index), slot * per_slot, (rows, cols))
        else:
            name = staged_name(s.layer, "a", s.index)
            views[a_name] = StorageView(name, 0, (rows, cols))
            staged.append(StagedSlice(s.layer, s.index, "a", name, (rows, cols), 1.0))
        maps[b_name] = _single(b_name, s.b_shape, s.b_box, dtype, rank)
        name = staged_name(s.layer, "b", s.index)
        views[b_name] = StorageView(name, 0, s.b_box.extent)  # type: ignore[arg-type]
        staged.append(StagedSlice(s.layer, s.index, "b", name, s.b_box.extent, scaling))  # type: ignore[arg-type]
    return LocalTargets(rank, maps, views, {}, ()), staged
