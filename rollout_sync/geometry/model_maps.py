"""Every map of a model, from shapes alone, for each side: ``trainer_maps`` (DeepSpeed sources) and
``vllm_target_maps`` (vLLM targets). The plan benchmark and the dry-run simulator call these; the live
adapters must produce identical maps. This module only composes: DeepSpeed's arithmetic (AutoTP splits,
ZeRO storages, the rank table) is in ``trainer.deepspeed_geometry``, vLLM's in ``rollout.vllm_geometry``.

Global-rank numbering of the sync group:

- trainer ranks first, ``0 .. T-1`` with ``T = dp · tp``. Within the trainer ``rank = dp_rank · tp +
  tp_rank`` (DeepSpeed 0.19.8 ``utils/groups.py: _init_tp_mesh_device`` builds a ``(data_parallel,
  tensor_parallel)`` mesh: TP groups are consecutive ranks, DP groups are strided by ``tp``), unless a
  ``rank_table[tp_rank][dp_rank]`` is given. With AutoEP (``ep > 1``, ``tp == 1``) DeepSpeed's legacy
  expert groups apply (``_create_expert_and_data_parallel``): EP groups are consecutive ranks, ``ep_rank =
  rank % ep``, expert-data-parallel rank ``rank // ep``;
- rollout ranks after, engine by engine: worker ``w`` (its TP rank) of engine ``k`` is
  ``first_rank + k · tp + w``.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from ..errors import LayoutError, UnsupportedLayoutError
from ..layout.builders import replicated_layout, replicated_map, split_layout
from ..layout.maps import TensorMap
from ..layout.nesting import nest
from ..layout.shards import Layout, Shard, ShardStorage, Whole
from ..shapes.tensors import EXPERT_KINDS, LogicalTensor, ModelTensors
from .deepspeed import autotp_split, tp_zero_map, trainer_rank_table, zero3_runs
from .vllm import (
    vllm_column_map,
    vllm_engine_ranks,
    vllm_expert_map,
    vllm_gate_up_part_map,
    vllm_qkv_part_map,
    vllm_replicated_map,
    vllm_row_map,
    vllm_vocab_map,
)

__all__ = [
    "trainer_maps",
    "vllm_target_maps",
]


def _reused(cache: dict[object, TensorMap], key: object, t: LogicalTensor, dtype: str) -> TensorMap | None:
    """Maps of tensors with the same layout facts differ only by name: the first is built, later ones
    reuse its (immutable) storages and pieces. Keeps whole-model builds cheap
    (the 36 layers of Qwen3-8B, the 61 layers of Kimi-K2 share their structures)."""
    got = cache.get(key)
    if got is None:
        return None
    return TensorMap(t.name, t.shape, dtype, got.ranks)  # the same storage objects: validation is memoized


def trainer_maps(
    model: ModelTensors,
    zero_stage: int,
    dp: int,
    tp: int = 1,
    ep: int = 1,
    dtype: str = "bfloat16",
    *,
    rank_table: Sequence[Sequence[int]] | None = None,
    alignment: int = 1,
    tp_grain: int = 1,
) -> list[TensorMap]:
    """Source maps of every logical tensor of ``model`` held by a DeepSpeed engine of ``dp × tp`` ranks.

    Dense tensors: AutoTP layout (``autotp_shape_layout``) × ZeRO storage of each TP shard over its DP group
    (``tp_zero_map``; ZeRO-3 partitions with ``alignment``). Buffers: whole on every rank.

    Experts:
    - ``ep == 1`` (no AutoEP; ``tp`` must be 1): transformers' fused ``experts.gate_up_proj [E, 2I, H]`` /
      ``experts.down_proj [E, H, I]``. ZeRO-0/1/2: every DP rank holds the N-D views ``gate_up_proj[e, :I]``
      (gate), ``gate_up_proj[e, I:]`` (up), ``down_proj[e]`` (down). ZeRO-3: the fused parameter's
      flattening is partitioned over the DP ranks; expert ``e``'s gate is its range ``[e·2IH, e·2IH +
      IH)``, up ``[e·2IH + IH, (e+1)·2IH)``, down ``[e·HI, (e+1)·HI)`` (``zero3_runs`` with ``base``).
    - ``ep > 1`` (AutoEP, ``tp == 1``, ``E % ep == 0``): EP rank ``k`` holds experts ``[k·E/ep,
      (k+1)·E/ep)`` packed as ``w1`` (gate) / ``w3`` (up) ``[E/ep, I, H]`` and ``w2`` (down) ``[E/ep, H,
      I]``; local index ``l = e − k·E/ep``. ZeRO-0/1/2: every expert-DP replica holds ``w1[l]`` etc.
      ZeRO-3: the packed parameter is partitioned over the ``dp/ep`` expert-DP ranks; expert ``l`` is the
      range ``[l·IH, (l+1)·IH)``.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise LayoutError("unknown ZeRO stage", expected="0, 1, 2 or 3", found=zero_stage)
    table = tuple(tuple(r) for r in rank_table) if rank_table is not None else trainer_rank_table(dp, tp)
    if len(table) != tp or any(len(r) != dp for r in table):
        raise LayoutError(
            "rank table is not tp × dp", expected=(tp, dp), found=(len(table), [len(r) for r in table])
        )
    world = tuple(sorted(r for row in table for r in row))
    has_experts = any(t.kind in EXPERT_KINDS for t in model.tensors)
    if has_experts and tp > 1:
        raise UnsupportedLayoutError(
            "AutoTP with MoE experts (DeepSpeed 0.19.8 refuses the experts' tp_plan styles)",
            tensor=model.model_type,
            expected="tp == 1",
            found=tp,
        )
    if ep > 1 and (dp % ep or model.num_experts % ep):
        raise LayoutError(
            "AutoEP needs ep to divide dp and the expert count",
            tensor=model.model_type,
            expected=f"divisors of dp={dp} and E={model.num_experts}",
            found=ep,
        )
    maps: list[TensorMap] = []
    cache: dict[object, TensorMap] = {}  # see _reused
    for t in model.tensors:
        tdtype = t.dtype or dtype
        split = None
        key: object
        if t.buffer:
            key = ("buffer", t.shape, tdtype)
        elif t.kind in EXPERT_KINDS:
            key = (t.kind, t.expert, t.shape, tdtype)
        else:
            split = autotp_split(t, tp, model.num_kv_heads, tp_grain, model.tied_embeddings)
            key = ("dense", t.shape, tdtype, split)
        m = _reused(cache, key, t, tdtype)
        if m is None:
            if t.buffer:
                m = replicated_map(t.name, t.shape, tdtype, world)
            elif t.kind in EXPERT_KINDS:
                m = _trainer_expert(t, model, zero_stage, table, ep, tdtype, alignment)
            else:
                layout = (
                    replicated_layout(t.name, t.shape, tp)
                    if split is None
                    else split_layout(t.name, t.shape, split[0], split[1])
                )
                m = tp_zero_map(layout, tdtype, zero_stage, table, alignment)
            cache[key] = m
        maps.append(m)
    return maps


def _trainer_expert(
    t: LogicalTensor,
    model: ModelTensors,
    zero_stage: int,
    table: tuple[tuple[int, ...], ...],
    ep: int,
    dtype: str,
    alignment: int,
) -> TensorMap:
    dp_ranks = table[0]  # tp == 1
    e = t.expert if t.expert is not None else 0
    numel = prod(t.shape)
    whole = Shard.of_box((0,) * len(t.shape), t.shape)
    if ep == 1:
        layout = Layout(t.name, t.shape, {0: whole})
        if zero_stage != 3:
            return nest(layout, {0: Whole(dp_ranks)}, dtype=dtype)
        if t.kind == "expert_down":
            base, param = e * numel, model.num_experts * numel
        else:
            base = e * 2 * numel + (numel if t.kind == "expert_up" else 0)
            param = model.num_experts * 2 * numel
        return nest(
            layout, {0: zero3_runs(dp_ranks, numel, alignment, param_numel=param, base=base)}, dtype=dtype
        )
    local = model.num_experts // ep
    ep_rank, idx = divmod(e, local)
    edp_ranks = dp_ranks[ep_rank::ep]  # expert-DP group of this EP rank, in expert-DP rank order
    layout = Layout(t.name, t.shape, {ep_rank: whole})
    storage: ShardStorage
    if zero_stage != 3:
        storage = Whole(edp_ranks)
    else:
        storage = zero3_runs(edp_ranks, numel, alignment, param_numel=local * numel, base=idx * numel)
    return nest(layout, {ep_rank: storage}, dtype=dtype)


def vllm_target_maps(
    model: ModelTensors,
    engines: int,
    tp: int,
    ep: int = 1,
    first_rank: int = 0,
    dtype: str = "bfloat16",
    *,
    placement: str = "linear",
    vocab_padding: int = 64,
) -> list[TensorMap]:
    """Target maps of every logical tensor of ``model`` over ``engines`` vLLM engines of ``tp`` workers
    each, the first worker at global rank ``first_rank``. ``ep`` is 1 (experts split along I by TP) or
    ``tp`` (``enable_expert_parallel``: experts placed over the engine's workers by ``placement``). Storage
    views: see ``rollout_sync.layout.builders``. Tensors vLLM keeps no storage for (``in_vllm`` False)
    get no target map."""
    if ep not in (1, tp):
        raise UnsupportedLayoutError(
            "vLLM expert parallelism within an engine spans its TP ranks",
            expected=f"ep in (1, {tp})",
            found=ep,
        )
    engine_ranks = vllm_engine_ranks(engines, tp, first_rank)
    maps: list[TensorMap] = []
    cache: dict[object, TensorMap] = {}  # see _reused
    for t in model.tensors:
        if not t.in_vllm:
            continue
        tdtype = t.dtype or dtype
        key = (t.kind, t.shape, tdtype, t.expert if t.kind in EXPERT_KINDS else None)
        m = _reused(cache, key, t, tdtype)
        if m is None:
            m = cache[key] = _vllm_map(t, model, tdtype, engine_ranks, ep, placement, vocab_padding)
        maps.append(m)
    return maps


def _vllm_map(
    t: LogicalTensor,
    model: ModelTensors,
    tdtype: str,
    engine_ranks: tuple[tuple[int, ...], ...],
    ep: int,
    placement: str,
    vocab_padding: int,
) -> TensorMap:
    kind = t.kind
    if kind in ("q", "k", "v"):
        m = vllm_qkv_part_map(
            t.name,
            t.shape,
            tdtype,
            kind,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            engine_ranks,
        )
    elif kind in ("gate", "up"):
        m = vllm_gate_up_part_map(t.name, t.shape, tdtype, engine_ranks)
    elif kind == "column":
        m = vllm_column_map(t.name, t.shape, tdtype, engine_ranks)
    elif kind == "row":
        m = vllm_row_map(t.name, t.shape, tdtype, engine_ranks)
    elif kind == "vocab":
        m = vllm_vocab_map(t.name, t.shape, tdtype, engine_ranks, vocab_padding)
    elif kind == "replicated":
        m = vllm_replicated_map(t.name, t.shape, tdtype, engine_ranks)
    elif kind in EXPERT_KINDS:
        m = vllm_expert_map(
            t.name,
            t.shape,
            tdtype,
            kind[len("expert_") :],
            t.expert if t.expert is not None else 0,
            model.num_experts,
            engine_ranks,
            expert_parallel=ep > 1,
            placement=placement,
        )
    else:
        raise LayoutError("unknown tensor kind", tensor=t.name, found=kind)
    return m
