"""Plain-data form of a worker's ``LocalTargets``: JSON-able dicts and lists only (no pickle), so a worker
can return it through vLLM's ``collective_rpc`` (msgpack offline, JSON over HTTP) and the driver rebuilds
it exactly. Versioned; another version is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import WireFormatError
from ..layout.box import Box
from ..layout.maps import Piece, RankStorage, TensorMap
from .local_targets import LocalTargets
from .storage_view import StorageView

__all__ = ["CODEC_VERSION", "local_targets_from_dict", "local_targets_to_dict"]

CODEC_VERSION = 1


def local_targets_to_dict(targets: LocalTargets) -> dict[str, Any]:
    tensors = {}
    for name, tmap in targets.maps.items():
        storage = tmap.ranks[targets.rank]
        tensors[name] = {
            "shape": list(tmap.shape),
            "dtype": tmap.dtype,
            "storage_shape": list(storage.shape),
            "pieces": [
                [list(p.box.origin), list(p.box.extent), p.offset, list(p.strides)] for p in storage.pieces
            ],
            "view": targets.views[name].to_dict(),
        }
    return {
        "version": CODEC_VERSION,
        "rank": targets.rank,
        "tensors": tensors,
        "refused": dict(targets.refused),
        "absent": list(targets.absent),
    }


def _tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        raise WireFormatError(f"{what} must be a list of integers, found {value!r}")
    return tuple(value)


def local_targets_from_dict(data: Mapping[str, Any]) -> LocalTargets:
    if not isinstance(data, Mapping) or data.get("version") != CODEC_VERSION:
        found = data.get("version") if isinstance(data, Mapping) else type(data).__name__
        raise WireFormatError(f"local targets of codec version {CODEC_VERSION} expected, found {found!r}")
    rank = data["rank"]
    if not isinstance(rank, int):
        raise WireFormatError(f"rank must be an integer, found {rank!r}")
    maps: dict[str, TensorMap] = {}
    views: dict[str, StorageView] = {}
    for name, entry in data["tensors"].items():
        pieces = []
        for raw in entry["pieces"]:
            if not isinstance(raw, (list, tuple)) or len(raw) != 4 or not isinstance(raw[2], int):
                raise WireFormatError(f"malformed piece {raw!r} of tensor {name!r}")
            box = Box(_tuple(raw[0], "box origin"), _tuple(raw[1], "box extent"))
            pieces.append(Piece(box, raw[2], _tuple(raw[3], "strides"), (rank,)))
        storage = RankStorage(_tuple(entry["storage_shape"], "storage shape"), tuple(pieces))
        maps[name] = TensorMap(name, _tuple(entry["shape"], "shape"), str(entry["dtype"]), {rank: storage})
        views[name] = StorageView.from_dict(entry["view"])
    refused = {str(k): str(v) for k, v in data["refused"].items()}
    return LocalTargets(rank, maps, views, refused, tuple(str(a) for a in data["absent"]))
