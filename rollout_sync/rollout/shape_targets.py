"""One vLLM worker's target maps from the model's shapes and the engine's parallel config (pure).

The fast path of setup: ``vllm_target_maps`` (the arithmetic of vLLM's loaders: output partition sizes, TP
rank, vocab padding, expert placement) gives each tensor's boxes and storage shape on this worker;
``vllm_param_views`` (here: vLLM's parameter names and fused offsets) gives the parameter and offset of each storage. The result has exactly the form the
loader probe produces (``local_targets.LocalTargets``: one rank, holders this rank alone) and is confirmed
on the live engine by ``check.check_targets`` before it is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from ..errors import LayoutError, UnsupportedLayoutError
from ..geometry.model_maps import vllm_target_maps
from ..geometry.vllm import vllm_expert_owner
from ..layout.maps import Piece, RankStorage, TensorMap
from ..shapes.tensors import EXPERT_KINDS, ModelTensors
from .local_targets import LocalTargets
from .storage_view import StorageView

__all__ = ["VLLM_VIEW_MODEL_TYPES", "shape_targets", "vllm_param_views"]


def shape_targets(
    model: ModelTensors,
    shapes: Mapping[str, tuple[int, ...]],
    param_dtypes: Mapping[str, str],
    *,
    rank: int,
    tp_rank: int,
    tp: int,
    ep: int = 1,
    placement: str = "linear",
    vocab_padding: int = 64,
) -> LocalTargets:
    """This worker's part of the target maps of the tensors ``shapes`` (name -> logical shape), worker
    ``tp_rank`` of an engine of ``tp`` workers at global rank ``rank``. ``param_dtypes``: the worker's
    parameters (name -> dtype; a map's dtype is that of the parameter its storage lives in).

    Raises ``UnsupportedLayoutError`` when the shape table does not describe these tensors (another model
    type, a tensor it does not know, another shape) or a storage names a parameter the worker lacks: the
    caller probes the loaders instead."""
    table = {t.name: t for t in model.tensors}
    for name, shape in shapes.items():
        known = table.get(name)
        if known is None or known.shape != tuple(shape):
            raise UnsupportedLayoutError(
                "the model's shape table does not describe this tensor",
                tensor=name,
                expected=f"{model.model_type} shape table",
                found="absent" if known is None else f"shape {tuple(shape)}, table {known.shape}",
            )
    first = rank - tp_rank
    built = {
        m.name: m
        for m in vllm_target_maps(model, 1, tp, ep, first, placement=placement, vocab_padding=vocab_padding)
    }
    storages: dict[str, RankStorage] = {}
    absent: list[str] = []
    for name in shapes:
        m = built.get(name)
        if m is None or rank not in m.ranks:
            absent.append(name)
        else:
            storages[name] = m.ranks[rank]
    placed = vllm_param_views(
        model, {n: s.shape for n, s in storages.items()}, tp=tp, ep=ep, placement=placement
    )
    maps: dict[str, TensorMap] = {}
    views: dict[str, StorageView] = {}
    for name, storage in storages.items():
        param, offset = placed[name]
        dtype = param_dtypes.get(param)
        if dtype is None:
            raise UnsupportedLayoutError(
                "the worker has no parameter where the shape table puts this tensor",
                tensor=name,
                rank=rank,
                expected=f"parameter {param!r}",
                found="none",
            )
        local = RankStorage(
            storage.shape, tuple(Piece(p.box, p.offset, p.strides, (rank,)) for p in storage.pieces)
        )
        maps[name] = TensorMap(name, tuple(shapes[name]), dtype, {rank: local})
        views[name] = StorageView(param, offset, storage.shape)
    return LocalTargets(rank, maps, views, {}, tuple(absent))


# vLLM model types whose parameter names and fused layouts ``vllm_param_views`` knows (vLLM 0.32
# ``models/qwen3.py``, ``qwen3_moe.py``: ``packed_modules_mapping`` and ``FusedMoE`` expert parameters).
VLLM_VIEW_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})
_FUSED_PARTS = {"q": ("qkv_proj", "qkv"), "k": ("qkv_proj", "qkv"), "v": ("qkv_proj", "qkv")}
_FUSED_PARTS |= {"gate": ("gate_up_proj", "gu"), "up": ("gate_up_proj", "gu")}
_PART_ORDER = {"qkv": ("q_proj", "k_proj", "v_proj"), "gu": ("gate_proj", "up_proj")}


def vllm_param_views(
    model: ModelTensors,
    storages: Mapping[str, tuple[int, ...]],
    *,
    tp: int,
    ep: int = 1,
    placement: str = "linear",
) -> dict[str, tuple[str, int]]:
    """Where each tensor's storage sits in one vLLM worker's parameters: ``name -> (parameter, flat
    offset)`` for every tensor in ``storages`` (name -> storage shape on this worker, as the target maps
    give it), by vLLM's own arithmetic:

    - ``q``/``k``/``v`` in ``qkv_proj`` one after another, ``gate``/``up`` in ``gate_up_proj``: a part's
      offset is the sum of the storages of the parts before it on this worker (``QKVParallelLinear``,
      ``MergedColumnParallelLinear`` shard offsets);
    - routed experts in ``FusedMoE``'s ``experts.routed_experts.w13_weight [E_local, 2·I_local, H]`` (gate
      then up) and ``experts.routed_experts.w2_weight [E_local, H, I_local]`` (vLLM 0.32's names), at the expert's local index (``vllm_expert_owner`` under
      expert parallelism, the expert's own index without);
    - every other tensor is its own parameter, from offset 0.

    Only for ``VLLM_VIEW_MODEL_TYPES``; another model type raises ``UnsupportedLayoutError`` (its storage
    views are learned by probing the loaders instead)."""
    if model.model_type not in VLLM_VIEW_MODEL_TYPES:
        raise UnsupportedLayoutError(
            "no vLLM parameter arithmetic for this model type",
            tensor=model.model_type,
            expected=f"one of {sorted(VLLM_VIEW_MODEL_TYPES)}",
            found=model.model_type,
        )
    kinds = {t.name: t for t in model.tensors}
    out: dict[str, tuple[str, int]] = {}
    for name, shape in storages.items():
        t = kinds.get(name)
        if t is None:
            raise LayoutError("tensor not in the model's shape table", tensor=name, found=model.model_type)
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if t.kind in _FUSED_PARTS:
            fused, group = _FUSED_PARTS[t.kind]
            offset = 0
            for part in _PART_ORDER[group]:
                if part == proj:
                    break
                sibling = f"{parent}.{part}.{leaf}"
                if sibling not in storages:
                    raise LayoutError(
                        "a fused part's offset needs the storages of the parts before it",
                        tensor=name,
                        expected=f"a storage for {sibling!r} on this worker",
                        found="none",
                    )
                offset += prod(storages[sibling])
            out[name] = (f"{parent}.{fused}.{leaf}", offset)
        elif t.kind in EXPERT_KINDS:
            experts, _, index = parent.rpartition(".")
            local = (
                int(index) if ep == 1 else vllm_expert_owner(int(index), model.num_experts, tp, placement)[1]
            )
            numel = prod(shape)
            if t.kind == "expert_down":
                out[name] = (f"{experts}.routed_experts.w2_{leaf}", local * numel)
            else:
                up = numel if t.kind == "expert_up" else 0
                out[name] = (f"{experts}.routed_experts.w13_{leaf}", local * 2 * numel + up)
        else:
            out[name] = (name, 0)
    return out
