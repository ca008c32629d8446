"""One vLLM worker's target maps from the model's shapes and the engine's parallel config (pure).

The fast path of setup: ``vllm_target_maps`` (the arithmetic of vLLM's loaders: output partition sizes, TP
rank, vocab padding, expert placement) gives each tensor's boxes and storage shape on this worker;
``vllm_param_views`` gives the parameter and offset of each storage. The result has exactly the form the
loader probe produces (``local_targets.LocalTargets``: one rank, holders this rank alone) and is confirmed
on the live engine by ``check.check_targets`` before it is used.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import UnsupportedLayoutError
from ..layout.maps import Piece, RankStorage, TensorMap
from ..shapes.sides import vllm_param_views, vllm_target_maps
from ..shapes.tensors import ModelTensors
from .local_targets import LocalTargets
from .storage_view import StorageView

__all__ = ["shape_targets"]


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
