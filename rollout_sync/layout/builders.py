"""Pure map builders: a ``TensorMap`` from layout facts alone (shapes, group sizes, rank tables, partition
sizes, alignment, padding). No process group, no torch, no vLLM or DeepSpeed import.

The live adapters read the same facts from a live engine and take exactly the storage views documented
here; the dry-run simulator and the plan benchmark call these builders directly.

Layout builders (``*_layout``) return a ``Layout`` in group ranks; storage builders return the
``ShardStorage`` of one shard; map builders (``*_map``) compose them with ``nest`` into a ``TensorMap`` in
global ranks. Rank numbering conventions (which global rank is which TP/DP/EP rank) are the callers'
(``rollout_sync.models.sides`` documents the trainer's and vLLM's).

Storage views, trainer side (DeepSpeed 0.19.8):

- **ZeRO-0/1/2**: each DP replica's storage is ``param.data`` (the low-precision parameter, a view into
  ``bit16_groups_flat`` under ZeRO-1/2) with the parameter's own (TP shard) shape, row-major. All DP ranks
  of the group are holders (``zero_replica_map``, ``Whole`` storage).
- **ZeRO-3**: ``param.ds_tensor`` of DP rank ``k`` holds elements ``[k·p, (k+1)·p)`` of the parameter's
  (TP shard's) row-major flattening, ``p = ceil(numel / dp)`` (rounded up to ``alignment`` if given); the
  last partition is padded. The storage is ``ds_tensor[0 : max(0, min(p, numel − k·p))]`` (padding
  excluded), shape ``(n,)``; a rank whose partition is all padding has an empty storage ``(0,)``
  (``zero3_map``, ``zero3_runs``).

Storage views, vLLM side (0.32), per TP rank ``r`` of an engine of TP size ``t`` (every view is a
contiguous slice of the real parameter, so its own strides are row-major):

- column parallel (``ColumnParallelLinear``, vLLM param ``[rows/t, cols]``): logical rows
  ``[r·rows/t, (r+1)·rows/t)``; storage = the whole parameter.
- row parallel (``RowParallelLinear``, param ``[rows, cols/t]``): logical columns ``[r·cols/t, ...)``;
  storage = the whole parameter.
- fused qkv (``QKVParallelLinear`` ``qkv_proj.weight`` ``[(q_heads_local + 2·kv_heads_local)·head_dim, H]``):
  logical ``q_proj.weight`` storage = ``qkv_proj.weight[0 : Q]``, ``k_proj`` = ``qkv_proj.weight[Q : Q+K]``,
  ``v_proj`` = ``qkv_proj.weight[Q+K : Q+2K]`` with ``Q = heads/t·head_dim`` and ``K = kv_heads_local·
  head_dim``; q holds heads ``[r·heads/t, (r+1)·heads/t)``. When ``t >= kv_heads`` every rank holds one kv
  head, ``r // (t / kv_heads)``: ranks with the same kv head are replicas (holders).
- fused gate_up (``MergedColumnParallelLinear`` ``gate_up_proj.weight`` ``[2·I/t, H]``): logical
  ``gate_proj.weight`` storage = ``gate_up_proj.weight[0 : I/t]``, ``up_proj.weight`` =
  ``gate_up_proj.weight[I/t : 2·I/t]``; both hold rows ``[r·I/t, (r+1)·I/t)``.
- vocab parallel (``VocabParallelEmbedding`` / ``ParallelLMHead`` ``[P/t, H]``, ``P = vocab`` padded to a
  multiple of ``padding`` (64)): rank ``r`` holds logical rows ``[r·P/t, min((r+1)·P/t, vocab))``; storage =
  ``weight[0 : n_real]`` (padding rows excluded; may be empty, shape ``(0, H)``).
- replicated (norms, routers, ``e_score_correction_bias``, MLA ``q_a_proj``/``kv_a_proj_with_mqa``):
  storage = the whole parameter, identical on every rank: all ranks are holders. With a q-LoRA rank vLLM
  fuses the two MLA down-projections into a replicated ``fused_qkv_a_proj.weight [q_lora + kv_lora +
  rope, H]``: ``q_a_proj`` storage = rows ``[0, q_lora)``, ``kv_a_proj_with_mqa`` = rows ``[q_lora,
  q_lora + kv_lora + rope)``. MLA's ``q_b_proj``/``kv_b_proj`` are column parallel (heads split), ``o_proj``
  row parallel. Trap: vLLM's MLA backends derive ``W_UK``/``W_UV`` from ``kv_b_proj`` after loading (a
  derived copy): a write into ``kv_b_proj`` needs that post-processing again.
- MoE experts (``FusedMoE`` ``w13_weight`` ``[E_local, 2·I_local, H]``, ``w2_weight`` ``[E_local, H,
  I_local]``), expert ``e`` at local index ``l``: ``experts.{e}.gate_proj.weight`` storage =
  ``w13_weight[l, 0 : I_local]``, ``up_proj`` = ``w13_weight[l, I_local : 2·I_local]``, ``down_proj`` =
  ``w2_weight[l]``. Without EP, ``I_local = I/t`` (gate/up hold rows ``[r·I/t, ...)``, down holds columns
  ``[r·I/t, ...)``) and every rank holds every expert (``l = e``); with EP over the engine's ranks,
  ``I_local = I`` and expert ``e`` lives on one EP rank only (``vllm_expert_owner``). Trap: vLLM's CPU MoE
  backend prepacks these parameters in place after loading (see ENVIRONMENT.md); the map describes the
  checkpoint layout, the adapter must repack after a write.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from ..errors import LayoutError
from .maps import TensorMap
from .nesting import FlatRun, FlatRuns, Layout, Shard, ShardBlock, ShardStorage, Whole, nest

__all__ = [
    "autotp_shard_sizes",
    "even_sizes",
    "replicated_layout",
    "replicated_map",
    "split_layout",
    "split_map",
    "sub_param_layout",
    "tp_zero_map",
    "vllm_column_map",
    "vllm_expert_map",
    "vllm_expert_owner",
    "vllm_gate_up_part_map",
    "vllm_qkv_part_map",
    "vllm_replicated_map",
    "vllm_row_map",
    "vllm_vocab_map",
    "vllm_vocab_rows",
    "zero3_map",
    "zero3_partition_numel",
    "zero3_runs",
    "zero_replica_map",
]


# ----------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------


def even_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Near-even split of ``total`` into ``parts`` contiguous sizes; the first ``total % parts`` get one more."""
    if parts <= 0 or total < 0:
        raise LayoutError("cannot split", expected="parts > 0 and total >= 0", found=(total, parts))
    base, rem = divmod(total, parts)
    return tuple(base + (1 if i < rem else 0) for i in range(parts))


def autotp_shard_sizes(
    total: int, tp: int, module_name: str, num_kv_heads: int | None, grain: int = 1
) -> tuple[int, ...]:
    """DeepSpeed AutoTP's split of a dimension of ``total`` over ``tp`` ranks (``deepspeed/module_inject/
    tp_shard.py: get_shard_size``, 0.19.8, training ``tp_grain_size`` default 1).

    ``module_name`` is the module's name as AutoTP sees it (``model.layers.0.self_attn.q_proj``). When the
    kv-head count is known, ``total`` is a multiple of it, the name contains no ``mlp`` and no MoE MLP
    projection name, and the module is not ``lm_head``/``embed_out``: whole kv-head groups, the first
    ``kv % tp`` ranks one more (ranks get 0 rows when ``tp > kv``). Otherwise near-even in units of
    ``grain``, the last rank taking the remainder ``total % grain``.
    """
    moe_mlp = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
    by_heads = (
        num_kv_heads is not None
        and num_kv_heads > 0
        and total % num_kv_heads == 0
        and "mlp" not in module_name
        and module_name not in ("lm_head", "embed_out")
        and not any(s in module_name for s in moe_mlp)
    )
    kv = num_kv_heads or 1
    sizes = []
    for rank in range(tp):
        if by_heads:
            slices = kv // tp + (1 if rank < kv % tp else 0)
            sizes.append(total * slices // kv)
        elif total >= grain:
            units, rem = divmod(total, grain)
            size = (units // tp + (1 if rank < units % tp else 0)) * grain
            if rank == tp - 1:
                size += rem
            sizes.append(size)
        else:
            sizes.append(total // tp + (1 if rank < total % tp else 0))
    if sum(sizes) != total:
        raise LayoutError(
            "AutoTP shard sizes do not tile the dimension",
            tensor=module_name,
            expected=total,
            found=sizes,
        )
    return tuple(sizes)


def zero3_partition_numel(numel: int, dp: int, alignment: int = 1) -> int:
    """ZeRO-3 partition size of a parameter of ``numel`` elements over ``dp`` ranks: ``ceil(numel/dp)``,
    rounded up to a multiple of ``alignment``."""
    if dp <= 0 or alignment <= 0 or numel < 0:
        raise LayoutError(
            "bad ZeRO-3 partition facts",
            expected="dp > 0, alignment > 0, numel >= 0",
            found=(numel, dp, alignment),
        )
    p = -(-numel // dp)
    return -(-p // alignment) * alignment


# ----------------------------------------------------------------------------------------------------------
# Layouts (group ranks) and storages
# ----------------------------------------------------------------------------------------------------------


def replicated_layout(name: str, shape: Sequence[int], n: int) -> Layout:
    """Layout ranks ``0..n-1`` each hold the whole tensor."""
    shape = tuple(shape)
    whole = Shard.of_box((0,) * len(shape), shape)
    return Layout(name, shape, dict.fromkeys(range(n), whole))


def split_layout(name: str, shape: Sequence[int], dim: int, sizes: Sequence[int]) -> Layout:
    """Layout rank ``i`` holds the contiguous range of ``sizes[i]`` indices along ``dim`` that follows
    rank ``i-1``'s (uneven and zero sizes allowed; a zero size is an empty shard)."""
    shape = tuple(shape)
    if not 0 <= dim < len(shape):
        raise LayoutError(
            "split dim outside the tensor", tensor=name, expected=f"0 <= dim < {len(shape)}", found=dim
        )
    if sum(sizes) != shape[dim] or any(s < 0 for s in sizes):
        raise LayoutError(
            "split sizes do not tile the split dim",
            tensor=name,
            expected=f"non-negative sizes summing to {shape[dim]}",
            found=tuple(sizes),
        )
    shards = {}
    start = 0
    for i, size in enumerate(sizes):
        origin = tuple(start if d == dim else 0 for d in range(len(shape)))
        extent = tuple(size if d == dim else s for d, s in enumerate(shape))
        shards[i] = Shard.of_box(origin, extent)
        start += size
    return Layout(name, shape, shards)


def sub_param_layout(
    name: str, shape: Sequence[int], dim: int, sub_sizes: Sequence[int], widths: Sequence[Sequence[int]]
) -> Layout:
    """A fused parameter made of sub-parameters stacked along ``dim`` (sizes ``sub_sizes``, e.g. q|k|v or
    gate|up), each split over the ranks: layout rank ``r`` holds, in order, the slice of width
    ``widths[i][r]`` of every sub-parameter ``i`` that follows rank ``r-1``'s (DeepSpeed's
    ``sub_param_map``). Rank ``r``'s shard stacks those slices along ``dim``."""
    shape = tuple(shape)
    ndim = len(shape)
    if not 0 <= dim < ndim or sum(sub_sizes) != shape[dim] or len(widths) != len(sub_sizes):
        raise LayoutError(
            "sub-parameter sizes do not tile the fused dim",
            tensor=name,
            expected=f"{len(sub_sizes)} sub-parameters summing to dim {dim} of {shape}",
            found=(tuple(sub_sizes), len(widths)),
        )
    ranks = len(widths[0]) if widths else 0
    for i, w in enumerate(widths):
        if len(w) != ranks or sum(w) != sub_sizes[i] or min(w, default=0) < 0:
            raise LayoutError(
                "sub-parameter widths do not tile their sub-parameter",
                tensor=name,
                expected=f"{ranks} widths summing to {sub_sizes[i]}",
                found=tuple(w),
            )
    shards = {}
    for r in range(ranks):
        blocks = []
        at = 0
        base = 0
        for i, size in enumerate(sub_sizes):
            width = widths[i][r]
            if width:
                start = base + sum(widths[i][:r])
                blocks.append(
                    ShardBlock(
                        tuple(at if d == dim else 0 for d in range(ndim)),
                        tuple(start if d == dim else 0 for d in range(ndim)),
                        tuple(width if d == dim else shape[d] for d in range(ndim)),
                    )
                )
            at += width
            base += size
        shards[r] = Shard(tuple(at if d == dim else shape[d] for d in range(ndim)), tuple(blocks))
    return Layout(name, shape, shards)


def zero3_runs(
    ranks: Sequence[int],
    numel: int,
    alignment: int = 1,
    *,
    param_numel: int | None = None,
    base: int = 0,
) -> FlatRuns:
    """ZeRO-3 storage of a shard of ``numel`` elements that occupies ``[base, base + numel)`` of a
    parameter's flattening (``param_numel`` elements, default ``numel``), partitioned over DP ranks
    ``ranks`` (in DP-rank order): DP rank ``k`` holds parameter elements ``[k·p, (k+1)·p)``, ``p =
    zero3_partition_numel(param_numel, len(ranks), alignment)``. The storage of this shard on that rank is
    the part of ``ds_tensor`` inside the shard's range: ``ds_tensor[max(0, base − k·p) : min(p, base +
    numel − k·p, param_numel − k·p)]`` (empty where they do not meet).

    ``base``/``param_numel`` serve a logical tensor that is a contiguous part of a bigger parameter (an
    expert ``e``'s ``gate_proj`` inside HF's fused ``gate_up_proj [E, 2I, H]``: ``base = e·2I·H``).
    """
    total = numel if param_numel is None else param_numel
    if base < 0 or base + numel > total:
        raise LayoutError(
            "shard range leaves its parameter",
            expected=f"[base, base+numel) inside [0, {total})",
            found=(base, numel),
        )
    p = zero3_partition_numel(total, len(ranks), alignment)
    runs = []
    for k, rank in enumerate(ranks):
        lo = max(base, k * p)
        hi = min(base + numel, (k + 1) * p, total)
        if hi < lo:
            hi = lo = 0
        else:
            lo -= base
            hi -= base
        runs.append(FlatRun(rank, lo, hi))
    return FlatRuns(tuple(runs))


# ----------------------------------------------------------------------------------------------------------
# Generic maps in global ranks
# ----------------------------------------------------------------------------------------------------------


def replicated_map(name: str, shape: Sequence[int], dtype: str, ranks: Sequence[int]) -> TensorMap:
    """Every rank of ``ranks`` holds the whole tensor (storage = the tensor itself, row-major); all are
    holders."""
    shape = tuple(shape)
    layout = Layout(name, shape, {0: Shard.of_box((0,) * len(shape), shape)})
    return nest(layout, {0: Whole(tuple(ranks))}, dtype=dtype)


def split_map(
    name: str, shape: Sequence[int], dtype: str, dim: int, sizes: Sequence[int], ranks: Sequence[int]
) -> TensorMap:
    """``ranks[i]`` holds ``sizes[i]`` contiguous indices along ``dim`` (uneven allowed), as an N-D storage
    of its shard's shape."""
    if len(sizes) != len(ranks):
        raise LayoutError("one size per rank", tensor=name, expected=len(ranks), found=len(sizes))
    layout = split_layout(name, shape, dim, sizes)
    return nest(layout, {i: Whole((r,)) for i, r in enumerate(ranks)}, dtype=dtype)


def zero_replica_map(name: str, shape: Sequence[int], dtype: str, dp_ranks: Sequence[int]) -> TensorMap:
    """ZeRO-0/1/2: every DP rank holds ``param.data`` whole (all DP ranks are holders)."""
    return replicated_map(name, shape, dtype, dp_ranks)


def zero3_map(
    name: str, shape: Sequence[int], dtype: str, dp_ranks: Sequence[int], alignment: int = 1
) -> TensorMap:
    """ZeRO-3 even partition of the tensor's flattening over ``dp_ranks`` (in DP-rank order); see
    ``zero3_runs``. Partitions start mid-row; the padding of the last partitions is excluded."""
    shape = tuple(shape)
    layout = Layout(name, shape, {0: Shard.of_box((0,) * len(shape), shape)})
    return nest(layout, {0: zero3_runs(dp_ranks, prod(shape), alignment)}, dtype=dtype)


def tp_zero_map(
    layout: Layout,
    dtype: str,
    zero_stage: int,
    rank_table: Sequence[Sequence[int]],
    alignment: int = 1,
) -> TensorMap:
    """AutoTP × ZeRO: the TP layout (layout ranks = TP ranks) nested with the ZeRO storage of each TP
    shard over its DP group. ``rank_table[tp_rank][dp_rank]`` is the global rank (DeepSpeed:
    ``dp_rank·tp + tp_rank``, see ``models.sides``). ZeRO-0/1/2: every DP rank holds the shard whole;
    ZeRO-3: the shard's flattening is partitioned over the DP ranks (``zero3_runs``)."""
    if zero_stage not in (0, 1, 2, 3):
        raise LayoutError("unknown ZeRO stage", tensor=layout.name, expected="0, 1, 2 or 3", found=zero_stage)
    storages: dict[int, ShardStorage] = {}
    for tp_rank, shard in layout.shards.items():
        if not 0 <= tp_rank < len(rank_table):
            raise LayoutError(
                "TP rank outside the rank table", tensor=layout.name, expected=len(rank_table), found=tp_rank
            )
        dp_ranks = tuple(rank_table[tp_rank])
        if zero_stage == 3:
            storages[tp_rank] = zero3_runs(dp_ranks, prod(shard.shape), alignment)
        else:
            storages[tp_rank] = Whole(dp_ranks)
    return nest(layout, storages, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------
# vLLM targets. ``engine_ranks[k]`` lists engine k's workers' global ranks in TP-rank order; the same
# tensor on several engines gives replicas (holders across engines).
# ----------------------------------------------------------------------------------------------------------


def _engines(layout_tp: Layout, dtype: str, engine_ranks: Sequence[Sequence[int]]) -> TensorMap:
    tp = len(engine_ranks[0]) if engine_ranks else 0
    if tp == 0 or any(len(e) != tp for e in engine_ranks):
        raise LayoutError(
            "every engine needs the same, non-zero number of workers",
            tensor=layout_tp.name,
            expected="equal TP sizes",
            found=[len(e) for e in engine_ranks],
        )
    shards = {}
    storages: dict[int, ShardStorage] = {}
    for k, workers in enumerate(engine_ranks):
        for tp_rank, shard in layout_tp.shards.items():
            shards[k * tp + tp_rank] = shard
            storages[k * tp + tp_rank] = Whole((workers[tp_rank],))
    return nest(Layout(layout_tp.name, layout_tp.shape, shards), storages, dtype=dtype)


def _divide(name: str, total: int, parts: int, what: str) -> int:
    if parts <= 0 or total % parts:
        raise LayoutError(
            f"{what} is not divisible by the TP size",
            tensor=name,
            expected=f"a multiple of {parts}",
            found=total,
        )
    return total // parts


def vllm_replicated_map(
    name: str, shape: Sequence[int], dtype: str, engine_ranks: Sequence[Sequence[int]]
) -> TensorMap:
    """Norms, routers, replicated linears: every worker holds the whole tensor."""
    tp = len(engine_ranks[0]) if engine_ranks else 1
    return _engines(replicated_layout(name, shape, tp), dtype, engine_ranks)


def vllm_column_map(
    name: str, shape: Sequence[int], dtype: str, engine_ranks: Sequence[Sequence[int]]
) -> TensorMap:
    """Column parallel: TP rank ``r`` holds rows ``[r·rows/t, (r+1)·rows/t)`` (storage = its parameter)."""
    shape = tuple(shape)
    tp = len(engine_ranks[0]) if engine_ranks else 1
    rows = _divide(name, shape[0], tp, "the row count")
    return _engines(split_layout(name, shape, 0, (rows,) * tp), dtype, engine_ranks)


def vllm_gate_up_part_map(
    name: str, shape: Sequence[int], dtype: str, engine_ranks: Sequence[Sequence[int]]
) -> TensorMap:
    """``gate_proj``/``up_proj`` inside ``gate_up_proj``: rows split like a column-parallel linear; the
    storage is the part's row range ``[0, I/t)`` (gate) or ``[I/t, 2·I/t)`` (up) of ``gate_up_proj``."""
    return vllm_column_map(name, shape, dtype, engine_ranks)


def vllm_row_map(
    name: str, shape: Sequence[int], dtype: str, engine_ranks: Sequence[Sequence[int]]
) -> TensorMap:
    """Row parallel: TP rank ``r`` holds columns ``[r·cols/t, (r+1)·cols/t)`` (storage = its parameter)."""
    shape = tuple(shape)
    tp = len(engine_ranks[0]) if engine_ranks else 1
    cols = _divide(name, shape[-1], tp, "the column count")
    return _engines(split_layout(name, shape, len(shape) - 1, (cols,) * tp), dtype, engine_ranks)


def vllm_qkv_part_map(
    name: str,
    shape: Sequence[int],
    dtype: str,
    part: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    engine_ranks: Sequence[Sequence[int]],
) -> TensorMap:
    """``q_proj``/``k_proj``/``v_proj`` (``part`` = ``"q"``, ``"k"``, ``"v"``) inside ``qkv_proj``.

    q: rank ``r`` holds heads ``[r·h/t, (r+1)·h/t)``. k, v: with ``t <= kv`` rank ``r`` holds kv heads
    ``[r·kv/t, (r+1)·kv/t)``; with ``t > kv`` (``t`` a multiple of ``kv``) rank ``r`` holds kv head ``r //
    (t/kv)`` and the ``t/kv`` ranks with the same head are holders of it. The storage is the part's row
    range of ``qkv_proj.weight`` (see the module docstring).
    """
    shape = tuple(shape)
    tp = len(engine_ranks[0]) if engine_ranks else 1
    heads = num_heads if part == "q" else num_kv_heads
    if part not in ("q", "k", "v"):
        raise LayoutError("unknown qkv part", tensor=name, expected="q, k or v", found=part)
    if shape[0] != heads * head_dim:
        raise LayoutError(
            "rows are not heads × head_dim", tensor=name, expected=heads * head_dim, found=shape[0]
        )
    if part != "q" and tp > heads:
        if tp % heads:
            raise LayoutError(
                "TP size is neither a divisor nor a multiple of the kv head count",
                tensor=name,
                expected=f"a multiple of {heads}",
                found=tp,
            )
        replicas = tp // heads
        shards = {
            r: Shard.of_box((r // replicas * head_dim, *(0,) * (len(shape) - 1)), (head_dim, *shape[1:]))
            for r in range(tp)
        }
        return _engines(Layout(name, shape, shards), dtype, engine_ranks)
    local = _divide(name, heads, tp, "the head count")
    return _engines(split_layout(name, shape, 0, (local * head_dim,) * tp), dtype, engine_ranks)


def vllm_vocab_rows(vocab: int, tp: int, padding: int = 64) -> tuple[tuple[int, int], ...]:
    """Per TP rank, the real logical rows ``(start, stop)`` of a vocab-parallel embedding / lm_head of
    ``vocab`` rows: the vocab is padded to a multiple of ``padding`` (``P``), rank ``r`` owns padded rows
    ``[r·P/t, (r+1)·P/t)`` and holds the real ones ``[min(r·P/t, vocab), min((r+1)·P/t, vocab))``."""
    padded = -(-vocab // padding) * padding
    per = _divide("vocab", padded, tp, f"the padded vocab ({padded})")
    return tuple((min(r * per, vocab), min((r + 1) * per, vocab)) for r in range(tp))


def vllm_vocab_map(
    name: str, shape: Sequence[int], dtype: str, engine_ranks: Sequence[Sequence[int]], padding: int = 64
) -> TensorMap:
    """Vocab-parallel embedding / lm_head: rank ``r`` holds rows ``vllm_vocab_rows(...)[r]``; the storage
    is ``weight[0 : stop − start]`` (padding rows excluded; an all-padding rank has shape ``(0, H)``)."""
    shape = tuple(shape)
    tp = len(engine_ranks[0]) if engine_ranks else 1
    rows = vllm_vocab_rows(shape[0], tp, padding)
    return _engines(split_layout(name, shape, 0, [b - a for a, b in rows]), dtype, engine_ranks)


def vllm_expert_owner(expert: int, num_experts: int, ep: int, placement: str = "linear") -> tuple[int, int]:
    """``(ep_rank, local_index)`` of ``expert`` under vLLM's placement (``determine_expert_map``): linear =
    contiguous ranges, the first ``E % ep`` ranks one more; round_robin = expert ``e`` on rank ``e % ep``."""
    if not 0 <= expert < num_experts or ep <= 0:
        raise LayoutError("expert outside the model", expected=f"0 <= expert < {num_experts}", found=expert)
    if placement == "round_robin":
        return expert % ep, expert // ep
    if placement != "linear":
        raise LayoutError("unknown expert placement", expected="linear or round_robin", found=placement)
    base, rem = divmod(num_experts, ep)
    cut = rem * (base + 1)
    if expert < cut:
        return expert // (base + 1), expert % (base + 1)
    return rem + (expert - cut) // base, (expert - cut) % base


def vllm_expert_map(
    name: str,
    shape: Sequence[int],
    dtype: str,
    part: str,
    expert: int,
    num_experts: int,
    engine_ranks: Sequence[Sequence[int]],
    expert_parallel: bool = False,
    placement: str = "linear",
) -> TensorMap:
    """One logical expert tensor (``part`` = ``"gate"``, ``"up"`` [I, H] or ``"down"`` [H, I]).

    Without EP every worker holds every expert, split along I by TP (gate/up: rows ``[r·I/t, ...)``,
    down: columns). With EP (EP size = the engine's TP size) the expert is whole on its owner only
    (``vllm_expert_owner``). Storage views: see the module docstring.
    """
    shape = tuple(shape)
    tp = len(engine_ranks[0]) if engine_ranks else 1
    if part not in ("gate", "up", "down"):
        raise LayoutError("unknown expert part", tensor=name, expected="gate, up or down", found=part)
    dim = 1 if part == "down" else 0
    if not expert_parallel:
        size = _divide(name, shape[dim], tp, "the expert intermediate size")
        return _engines(split_layout(name, shape, dim, (size,) * tp), dtype, engine_ranks)
    owner, _ = vllm_expert_owner(expert, num_experts, tp, placement)
    layout = Layout(name, shape, {owner: Shard.of_box((0,) * len(shape), shape)})
    return _engines(layout, dtype, engine_ranks)
