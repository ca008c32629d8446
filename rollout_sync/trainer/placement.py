"""Placements (which TP or EP rank holds which shard of a parameter) from DeepSpeed's own descriptions,
as ``Layout``s in placement ranks. Pure: plain dicts in, no torch, no DeepSpeed.

- AutoTP attaches to each parameter it splits an affine map (``ds_autotp_universal_checkpoint_meta
  ['conversion']['affine_map']``, format of ``deepspeed.checkpoint.affine.ParamAffineMap.to_dict``): per TP
  rank a shard shape and pieces ``{shape, source: [offset, strides], dest: [offset, strides], locations}``,
  ``source`` addressing the full parameter and ``dest`` the rank's shard, both row-major.
  ``autotp_layout`` turns it into a ``Layout`` (every piece must be a box on both sides, scale 1);
- AutoEP attaches an expert placement descriptor (``ds_autoep_uc_meta['expert_placement']``: per EP rank
  the experts it packs, in packed order); ``autoep_layout`` gives the layout of the packed parameter
  ``[experts, ...]`` (EP rank ``k``'s shard ``[len(experts_k), ...]``, local index ``l`` = expert
  ``experts_k[l]``); an expert on several EP ranks is held by all of them;
- ``single_layout`` / ``replicated_layout``: a parameter with no placement (one shard, placement rank 0),
  or one that every TP rank holds whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

from ..errors import LayoutError, NotAffineError, UnsupportedLayoutError
from ..layout.box import row_major_strides
from ..layout.shards import Layout, Shard, ShardBlock

__all__ = ["autoep_layout", "autotp_layout", "replicated_layout", "single_layout"]


def single_layout(name: str, shape: Sequence[int]) -> Layout:
    """One shard, the whole parameter, at placement rank 0."""
    shape = tuple(shape)
    return Layout(name, shape, {0: Shard.of_box((0,) * len(shape), shape)})


def replicated_layout(name: str, shape: Sequence[int], n: int) -> Layout:
    """Placement ranks ``0..n-1`` each hold the whole parameter."""
    shape = tuple(shape)
    whole = Shard.of_box((0,) * len(shape), shape)
    return Layout(name, shape, dict.fromkeys(range(n), whole))


def _unravel(
    name: str, offset: int, strides: Sequence[int], extent: Sequence[int], shape: Sequence[int]
) -> tuple[int, ...]:
    """Coordinates of ``offset`` in a row-major ``shape``, checking that ``strides`` are that shape's own
    strides on every axis the block spans (extent > 1)."""
    own = row_major_strides(tuple(shape))
    if len(strides) != len(shape) or any(
        e > 1 and s != o for e, s, o in zip(extent, strides, own, strict=True)
    ):
        raise NotAffineError(
            "an AutoTP piece is not a box of its tensor (strides are not the tensor's row-major strides)",
            tensor=name,
            expected=own,
            found=tuple(strides),
        )
    coords = []
    rest = offset
    for s in own:
        c, rest = divmod(rest, s) if s else (0, rest)
        coords.append(c)
    if rest or any(c + e > n for c, e, n in zip(coords, extent, shape, strict=True)):
        raise NotAffineError(
            "an AutoTP piece leaves its tensor",
            tensor=name,
            expected=tuple(shape),
            found=(offset, tuple(extent)),
        )
    return tuple(coords)


def autotp_layout(name: str, affine_map: Mapping[str, Any]) -> Layout:
    """The layout of a parameter from the affine map AutoTP attached to it (TP ranks as placement ranks)."""
    try:
        shape = tuple(int(s) for s in affine_map["logical_shape"])
        ranks = affine_map["ranks"]
        entries = {int(r): v for r, v in ranks.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise LayoutError("malformed AutoTP affine map", tensor=name, found=repr(exc)) from exc
    shards: dict[int, Shard] = {}
    for tp_rank in sorted(entries):
        entry = entries[tp_rank]
        shard_shape = tuple(int(s) for s in entry["shard_shape"])
        blocks = []
        for piece in entry["pieces"]:
            extent = tuple(int(s) for s in piece["shape"])
            if float(piece.get("scale", 1.0)) != 1.0:
                raise UnsupportedLayoutError(
                    "an AutoTP shard scaled by a factor (a pre-divided row-parallel bias)",
                    tensor=name,
                    rank=tp_rank,
                    expected="scale 1",
                    found=piece.get("scale"),
                )
            if tp_rank not in {int(r) for r in piece["locations"]}:
                raise LayoutError(
                    "an AutoTP piece listed on a rank that is not among its locations",
                    tensor=name,
                    rank=tp_rank,
                    found=piece["locations"],
                )
            if prod(extent) == 0:
                continue
            src_off, src_strides = int(piece["source"][0]), [int(s) for s in piece["source"][1]]
            dst_off, dst_strides = int(piece["dest"][0]), [int(s) for s in piece["dest"][1]]
            logical = _unravel(name, src_off, src_strides, extent, shape)
            local = _unravel(name, dst_off, dst_strides, extent, shard_shape)
            blocks.append(ShardBlock(local, logical, extent))
        shards[tp_rank] = Shard(shard_shape, tuple(blocks))
    return Layout(name, shape, shards)


def autoep_layout(name: str, shape: Sequence[int], placement: Mapping[str, Any]) -> Layout:
    """The layout of a packed expert parameter of full ``shape`` ``[num_experts, ...]`` from AutoEP's
    placement descriptor (EP ranks as placement ranks)."""
    shape = tuple(shape)
    try:
        num_experts = int(placement["num_experts"])
        entries = [(int(e["rank"]), [int(x) for x in e["experts"]]) for e in placement["ranks"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError("malformed AutoEP placement descriptor", tensor=name, found=repr(exc)) from exc
    if not shape or shape[0] != num_experts:
        raise LayoutError(
            "packed expert parameter does not lead with the expert axis",
            tensor=name,
            expected=f"[{num_experts}, ...]",
            found=shape,
        )
    rest = shape[1:]
    shards: dict[int, Shard] = {}
    for ep_rank, experts in entries:
        if any(not 0 <= e < num_experts for e in experts) or len(set(experts)) != len(experts):
            raise LayoutError(
                "AutoEP placement lists an expert twice or outside the model",
                tensor=name,
                rank=ep_rank,
                expected=f"distinct experts in [0, {num_experts})",
                found=experts,
            )
        blocks = []
        start = 0
        while start < len(experts):  # runs of consecutive experts become one block
            stop = start + 1
            while stop < len(experts) and experts[stop] == experts[stop - 1] + 1:
                stop += 1
            zeros = (0,) * len(rest)
            blocks.append(ShardBlock((start, *zeros), (experts[start], *zeros), (stop - start, *rest)))
            start = stop
        shards[ep_rank] = Shard((len(experts), *rest), tuple(blocks))
    return Layout(name, shape, shards)
