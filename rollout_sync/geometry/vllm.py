"""vLLM 0.32's storage geometry, as pure functions of shapes and the engine's parallel config: where each
logical tensor lands in a worker's parameters (no torch, no vLLM import). ``engine_ranks[k]`` lists engine
``k``'s workers' global ranks in TP-rank order; the same tensor on several engines gives replicas.

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

from ..errors import LayoutError
from ..layout.builders import replicated_layout, split_layout
from ..layout.maps import TensorMap
from ..layout.nesting import nest
from ..layout.shards import Layout, Shard, ShardStorage, Whole

__all__ = [
    "vllm_column_map",
    "vllm_engine_ranks",
    "vllm_expert_map",
    "vllm_expert_owner",
    "vllm_gate_up_part_map",
    "vllm_qkv_part_map",
    "vllm_replicated_map",
    "vllm_row_map",
    "vllm_vocab_map",
    "vllm_vocab_rows",
]

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


def vllm_engine_ranks(engines: int, tp: int, first_rank: int) -> tuple[tuple[int, ...], ...]:
    """Per engine, its workers' global ranks in TP-rank order."""
    if engines <= 0 or tp <= 0 or first_rank < 0:
        raise LayoutError(
            "bad rollout sizes",
            expected="engines > 0, tp > 0, first_rank >= 0",
            found=(engines, tp, first_rank),
        )
    return tuple(tuple(first_rank + k * tp + w for w in range(tp)) for k in range(engines))
