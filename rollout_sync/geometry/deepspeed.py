"""DeepSpeed 0.19.8's storage geometry, as pure functions of sizes: ZeRO-1/2 flat buffers, ZeRO-3
partitions, AutoTP shard sizes, and the maps they give (no torch, no DeepSpeed import).

ZeRO-1/2 flat buffers: ``DeepSpeedZeroOptimizer`` (``runtime/zero/stage_1_and_2.py``) and ``BF16_Optimizer``
(``runtime/bf16_optimizer.py``) flatten each optimizer group's trainable parameters into one buffer:

- in flat order (the group's order, or the round-robin order with ``round_robin_gradients``: parameter
  ``j`` goes to bucket ``j % dp`` and the buckets are concatenated);
- each parameter but the last followed by padding up to a multiple of ``param_alignment`` elements
  (``16 // gcd(16, element_size)`` with ``zero_optimization.parameter_alignment``, else 1; always 1 for
  ``BF16_Optimizer``);
- the whole padded to a multiple of ``2 · dp`` (``nccl_start_alignment_factor · dp``), and cut into ``dp``
  equal partitions; group rank ``i`` keeps the fp32 master weights and optimizer states of partition ``i``.


Storage views (DeepSpeed 0.19.8):

- **ZeRO-0/1/2**: each DP replica's storage is ``param.data`` (the low-precision parameter, a view into
  ``bit16_groups_flat`` under ZeRO-1/2) with the parameter's own (TP shard) shape, row-major. All DP ranks
  of the group are holders (``zero_replica_map``, ``Whole`` storage).
- **ZeRO-3**: ``param.ds_tensor`` of DP rank ``k`` holds elements ``[k·p, (k+1)·p)`` of the parameter's
  (TP shard's) row-major flattening, ``p = ceil(numel / dp)`` (rounded up to ``alignment`` if given); the
  last partition is padded. The storage is ``ds_tensor[0 : max(0, min(p, numel − k·p))]`` (padding
  excluded), shape ``(n,)``; a rank whose partition is all padding has an empty storage ``(0,)``
  (``zero3_map``, ``zero3_runs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd, prod
from typing import TYPE_CHECKING

from ..errors import LayoutError, UnsupportedLayoutError
from ..layout.builders import replicated_layout, replicated_map, split_layout
from ..layout.maps import TensorMap
from ..layout.nesting import nest
from ..layout.shards import FlatRun, FlatRuns, Layout, Shard, ShardStorage, Whole

if TYPE_CHECKING:
    from ..shapes.tensors import LogicalTensor

__all__ = [
    "autotp_shape_layout",
    "autotp_shard_sizes",
    "autotp_split",
    "param_alignment_for",
    "round_robin_order",
    "tp_zero_map",
    "trainer_rank_table",
    "zero3_map",
    "zero3_partition_numel",
    "zero3_runs",
    "zero12_flat_layout",
    "zero_replica_map",
]

NCCL_START_ALIGNMENT_FACTOR = 2


def round_robin_order(count: int, dp: int) -> tuple[int, ...]:
    """The flat order of ``count`` parameters under ``round_robin_gradients`` (indices into the group)."""
    if dp <= 0 or count < 0:
        raise LayoutError("bad round-robin facts", expected="dp > 0, count >= 0", found=(count, dp))
    return tuple(j for bucket in range(min(dp, count)) for j in range(bucket, count, dp))


def zero12_flat_layout(
    numels: Sequence[int], dp: int, *, param_alignment: int = 1
) -> tuple[tuple[int, ...], int]:
    """Offsets of parameters of ``numels`` elements (given in flat order) in their group's flat buffer, and
    the buffer's padded size (a multiple of ``2 · dp``)."""
    if dp <= 0 or param_alignment <= 0 or any(n < 0 for n in numels):
        raise LayoutError(
            "bad ZeRO-1/2 flat buffer facts",
            expected="dp > 0, param_alignment > 0, numels >= 0",
            found=(tuple(numels), dp, param_alignment),
        )
    offsets = []
    current = 0
    for i, n in enumerate(numels):
        offsets.append(current)
        current += n
        if i != len(numels) - 1:
            current += (-current) % param_alignment
    alignment = NCCL_START_ALIGNMENT_FACTOR * dp
    total = -(-current // alignment) * alignment
    return tuple(offsets), total


def param_alignment_for(element_size: int, parameter_alignment: bool) -> int:
    """``16 // gcd(16, element_size)`` elements when ``parameter_alignment`` is on, else 1."""
    return 16 // gcd(16, element_size) if parameter_alignment else 1


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


def trainer_rank_table(dp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """``table[tp_rank][dp_rank] = dp_rank · tp + tp_rank`` (DeepSpeed's AutoTP mesh)."""
    if dp <= 0 or tp <= 0:
        raise LayoutError("bad trainer sizes", expected="dp > 0 and tp > 0", found=(dp, tp))
    return tuple(tuple(d * tp + t for d in range(dp)) for t in range(tp))


def autotp_shape_layout(
    t: LogicalTensor, tp: int, num_kv_heads: int | None, grain: int = 1, *, tied: bool = False
) -> Layout:
    """DeepSpeed AutoTP's layout of one logical tensor over ``tp`` TP ranks (training mode, through
    transformers' ``base_model_tp_plan``): for Qwen3 ``q``/``k``/``v``/``gate``/``up`` and ``lm_head`` are
    split along rows, ``o_proj``/``down_proj`` along columns, with ``autotp_shard_sizes``; ``embed_tokens``,
    norms and routers whole on every TP rank (measured on tiny Qwen3, notes/deepspeed-on-cpu.md §3).

    Refused (``UnsupportedLayoutError``) rather than guessed: MoE experts (DeepSpeed 0.19.8 refuses their
    ``packed_colwise``/``moe_tp_experts`` plan styles) and MLA's column-parallel projections (never
    measured under AutoTP; transformers' DeepSeek-V3 plan leaves attention whole).

    ``tied``: the model ties ``lm_head`` to ``embed_tokens``; AutoTP splits the shared parameter by rows as
    it splits ``lm_head`` (measured on a tied tiny Qwen3), so ``embed_tokens`` is split the same way."""
    split = autotp_split(t, tp, num_kv_heads, grain, tied)
    if split is None:
        return replicated_layout(t.name, t.shape, tp)
    return split_layout(t.name, t.shape, split[0], split[1])


def autotp_split(
    t: LogicalTensor, tp: int, num_kv_heads: int | None, grain: int, tied: bool = False
) -> tuple[int, tuple[int, ...]] | None:
    """``(dim, sizes)`` of AutoTP's split of ``t``, or None where every TP rank holds it whole."""
    if tp == 1 or t.buffer:
        return None
    module = t.name.rsplit(".", 1)[0]
    if tied and t.kind == "vocab" and module.endswith("embed_tokens"):
        return 0, autotp_shard_sizes(t.shape[0], tp, "lm_head", num_kv_heads, grain)
    if t.kind in ("q", "k", "v", "gate", "up") or (t.kind == "vocab" and module == "lm_head"):
        dim = 0
    elif t.kind == "row" and len(t.shape) >= 2:
        dim = len(t.shape) - 1
    elif t.kind in ("replicated", "vocab", "row"):
        return None
    else:
        raise UnsupportedLayoutError(
            "AutoTP layout of this kind is not known (MoE experts, MLA projections)",
            tensor=t.name,
            found=t.kind,
        )
    return dim, autotp_shard_sizes(t.shape[dim], tp, module, num_kv_heads, grain)
