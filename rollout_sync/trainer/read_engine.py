"""Read layout facts, and this rank's own buffers, from a live DeepSpeed 0.19.8 engine.

Everything is read locally: no collective runs, so any rank may call this alone. Facts about other ranks
(their groups, their shards, where their shards sit in their flat buffers) follow from DeepSpeed's rules:

- AutoTP (``_init_tp_mesh_device``): a ``(data_parallel, tensor_parallel)`` mesh, global rank ``d·tp + t``;
  each parameter's TP placement is the affine map AutoTP attached to it (an untouched parameter is
  replicated over TP); each TP rank's shard is ZeRO-stored over its DP group ``[t, tp + t, ...]``;
- AutoEP (``_create_expert_and_data_parallel``, no model parallelism): EP groups are consecutive ranks,
  EP rank ``r % ep``; the expert-data-parallel (EDP) group of EP rank ``k`` is ``[k, k + ep, ...]``; the
  expert placement is the descriptor AutoEP attached to each packed parameter;
- ZeRO-1/2 flat buffers: ``rollout_sync.trainer.deepspeed_geometry``.

Every rule is checked against what this rank really has (its own groups, shard shapes, flat offsets,
partition sizes), and a disagreement is refused rather than guessed around.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
import torch.distributed as tdist

from ..errors import LayoutError, ShapeMismatchError, UnsupportedLayoutError
from ..layout.nesting import Layout
from .deepspeed_geometry import param_alignment_for, zero12_flat_layout
from .facts import LogicalPart, ParamFacts, TrainerFacts, ZeroGroup
from .naming import autoep_expert_parts, autoep_router_name, fused_expert_parts, plain_parts
from .placement import autoep_layout, autotp_layout, replicated_layout, single_layout
from .refusals import EngineTraits, refuse_engine

__all__ = ["LocalParam", "ReadEngine", "read_engine", "read_traits"]

AUTOTP_META = "ds_autotp_universal_checkpoint_meta"
AUTOEP_META = "ds_autoep_uc_meta"


@dataclass
class LocalParam:
    """This rank's own buffers of one parameter.

    ``lp`` holds the low-precision parameter's own shard: element ``x`` of the shard's flattening is
    ``lp[x + lp_shift]`` (for the elements this rank stores). ``hp`` is the fp32 master partition (also the
    key of the optimizer's per-tensor state) with ``hp_shift`` likewise; ``None`` for a parameter the
    optimizer does not own (frozen) or an engine without master weights (ZeRO-0).

    ``lp_source`` / ``hp_source`` fetch the tensor the engine holds *now* in the place ``lp`` / ``hp`` were
    read from (the parameter, its ``ds_tensor``, the optimizer's list entry): ``rollout_sync.trainer.freshness``
    compares them with the buffers the views were cut from, to notice a buffer DeepSpeed replaced.
    """

    name: str
    placement_rank: int
    lp: torch.Tensor
    lp_shift: int
    hp: torch.Tensor | None = None
    hp_shift: int = 0
    lp_source: Callable[[], Any] | None = None
    hp_source: Callable[[], Any] | None = None


@dataclass
class ReadEngine:
    """Facts (about every rank) and this rank's own buffers."""

    facts: TrainerFacts
    local: dict[str, LocalParam]
    basic_optimizer: Any
    rank: int
    #: The engine's basic optimizer now (whose ``state`` holds the Adam states), for freshness checks.
    optimizer_source: Callable[[], Any] | None = None


def _dtype(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in tdist.get_process_group_ranks(group))


def _device_of(config: Any) -> str:
    if config is None:
        return "none"
    device = getattr(config, "device", "none")
    return str(getattr(device, "value", device))


def read_traits(engine: Any) -> EngineTraits:
    """The engine-wide facts that decide whether its storage can be described."""
    zc = engine._config.zero_config
    stage = int(engine.zero_optimization_stage())
    opt = engine.optimizer
    offload_optimizer = _device_of(zc.offload_optimizer)
    offload_param = _device_of(zc.offload_param)
    if getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False):
        offload_optimizer = offload_optimizer if offload_optimizer != "none" else "cpu"
    if getattr(opt, "offload_param", False):
        offload_param = offload_param if offload_param != "none" else "cpu"
    ep_config = getattr(engine._config, "expert_parallel_config", None)
    has_autoep = _autoep_layers(engine.module) != {}
    sp = 1
    try:
        from deepspeed.utils import groups

        sp = int(groups._get_sequence_parallel_world_size())
    except (ImportError, AssertionError, AttributeError):
        sp = 1
    return EngineTraits(
        stage=stage,
        optimizer=type(opt).__name__ if opt is not None else "None",
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        quantized_weights=bool(zc.zero_quantized_weights or zc.zero_quantized_nontrainable_weights),
        hpz_partition_size=int(zc.zero_hpz_partition_size or 1),
        mics="MiCS" in type(opt).__name__,
        expert_tensor_parallel=int(getattr(ep_config, "expert_tensor_parallel_size", 1) or 1)
        if has_autoep
        else 1,
        autoep_with_autotp=has_autoep and int(engine.autotp_size() or 1) > 1,
        pipeline=type(engine).__name__ == "PipelineEngine",
        sequence_parallel=sp,
    )


def _autoep_layers(module: torch.nn.Module) -> dict[str, Any]:
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:
        return {}
    return {name: m for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)}


def _zero3_param(p: Any) -> bool:
    return getattr(p, "ds_tensor", None) is not None


def _full_param_shape(p: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in (p.ds_shape if _zero3_param(p) else p.shape))


class _Reader:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.stage = int(engine.zero_optimization_stage())
        self.rank = int(tdist.get_rank())
        self.world = int(tdist.get_world_size())
        self.tp = max(int(engine.autotp_size() or 1), 1)
        self.autoep = _autoep_layers(engine.module)
        self._groups()

    # -- groups ------------------------------------------------------------------------------------
    def _groups(self) -> None:
        from deepspeed.utils import groups

        dp_group = self.engine.seq_data_parallel_group
        self.dp_ranks = _ranks(dp_group) if dp_group is not None else tuple(range(self.world))
        tp = self.tp
        if self.world % tp:
            raise LayoutError(
                "world size is not a multiple of the AutoTP size", expected=tp, found=self.world
            )
        dp = self.world // tp
        self.table = tuple(tuple(d * tp + t for d in range(dp)) for t in range(tp))
        if tp > 1:
            tp_ranks = _ranks(groups.get_tensor_model_parallel_group())
            self.tp_rank = tp_ranks.index(self.rank)
            d = self.rank // tp
            if tp_ranks != tuple(d * tp + t for t in range(tp)) or self.dp_ranks != self.table[self.tp_rank]:
                raise LayoutError(
                    "DeepSpeed's TP/DP groups differ from the (data_parallel, tensor_parallel) mesh",
                    rank=self.rank,
                    expected=(tuple(d * tp + t for t in range(tp)), self.table[self.rank % tp]),
                    found=(tp_ranks, self.dp_ranks),
                )
        else:
            self.tp_rank = 0
            if self.dp_ranks != self.table[0]:
                raise LayoutError(
                    "the data-parallel group is not every rank",
                    rank=self.rank,
                    expected=self.table[0],
                    found=self.dp_ranks,
                )

    def _edp_table(self, group_name: str, ep: int, ep_rank: int) -> tuple[tuple[int, ...], ...]:
        """The EDP group of every EP rank, checked against this rank's own EP and EDP groups."""
        from deepspeed.utils import groups

        if self.world % ep:
            raise LayoutError("world size is not a multiple of the EP size", expected=ep, found=self.world)
        table = tuple(tuple(range(k, self.world, ep)) for k in range(ep))
        ep_ranks = tuple(int(r) for r in groups._get_expert_parallel_group_ranks(group_name))
        edp_ranks = tuple(int(r) for r in groups._get_expert_data_parallel_group_ranks(group_name))
        first = self.rank - self.rank % ep
        if (
            ep_ranks != tuple(range(first, first + ep))
            or edp_ranks != table[ep_rank]
            or self.rank % ep != ep_rank
        ):
            raise LayoutError(
                "DeepSpeed's expert groups differ from the expert-data-parallel table",
                tensor=group_name,
                rank=self.rank,
                expected=(tuple(range(first, first + ep)), table[self.rank % ep], self.rank % ep),
                found=(ep_ranks, edp_ranks, ep_rank),
            )
        return table

    # -- one parameter -----------------------------------------------------------------------------
    def placement(
        self, name: str, p: torch.nn.Parameter
    ) -> tuple[Layout, dict[int, ZeroGroup], int, tuple[LogicalPart, ...]]:
        """Placement, ZeRO group of each shard (without flat positions), own placement rank, logical parts."""
        block = name.rsplit(".", 1)[0]
        layer_name = next((ln for ln in self.autoep if name.startswith(ln + ".")), None)
        if layer_name is not None:
            return self._autoep_param(name, p, layer_name)
        tp_meta = getattr(p, AUTOTP_META, None)
        if tp_meta is not None and self.tp > 1:
            conversion = tp_meta.get("conversion", {}) if isinstance(tp_meta, dict) else {}
            amap = conversion.get("affine_map")
            if conversion.get("unsupported_reason") or amap is None:
                raise UnsupportedLayoutError(
                    "AutoTP describes no affine map for this parameter",
                    tensor=name,
                    found=conversion.get("unsupported_reason"),
                )
            layout = autotp_layout(name, amap)
            if set(layout.shards) != set(range(self.tp)):
                raise LayoutError(
                    "AutoTP affine map does not cover every TP rank",
                    tensor=name,
                    expected=self.tp,
                    found=sorted(layout.shards),
                )
        elif self.tp > 1:
            layout = replicated_layout(name, _full_param_shape(p), self.tp)
        else:
            layout = single_layout(name, _full_param_shape(p))
        zero = {k: ZeroGroup(self.table[k]) for k in layout.shards}
        shape = tuple(layout.shape)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and len(shape) == 3:
            if getattr(p, "is_transposed", False):
                raise UnsupportedLayoutError("transposed fused experts", tensor=name, found="is_transposed")
            parts = fused_expert_parts(block.rsplit(".", 1)[0], name.rsplit(".", 1)[1], shape)
        else:
            parts = plain_parts(name, shape)
        return layout, zero, self.tp_rank, parts

    def _autoep_param(
        self, name: str, p: torch.nn.Parameter, layer_name: str
    ) -> tuple[Layout, dict[int, ZeroGroup], int, tuple[LogicalPart, ...]]:
        from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

        layer = self.autoep[layer_name]
        family = str(layer.model_family)
        rest = name[len(layer_name) + 1 :]
        if rest in ("experts.w1", "experts.w2", "experts.w3"):
            meta = getattr(p, AUTOEP_META, None)
            if not isinstance(meta, dict):
                raise UnsupportedLayoutError("AutoEP expert parameter without its placement", tensor=name)
            shape = tuple(int(s) for s in meta["logical_shape"])
            layout = autoep_layout(name, shape, meta["expert_placement"])
            ep_rank = int(meta["ep_rank"])
            ep = len(layout.shards)
            if list(meta.get("local_experts", [])) != [
                b.logical_origin[0] + i for b in layout.shards[ep_rank].blocks for i in range(b.extent[0])
            ]:
                raise LayoutError(
                    "AutoEP local experts disagree with the placement",
                    tensor=name,
                    rank=self.rank,
                    found=meta.get("local_experts"),
                )
            group_name = getattr(p, "group_name", None) or layer.ep_group_name
            table = self._edp_table(str(group_name), ep, ep_rank)
            zero = {k: ZeroGroup(table[k]) for k in layout.shards}
            return (
                layout,
                zero,
                ep_rank,
                autoep_expert_parts(family, layer_name, rest.rsplit(".", 1)[1], shape),
            )
        if rest.startswith("router.gate."):
            preset = PRESET_MODELS.get(family)
            if preset is None:
                raise UnsupportedLayoutError("unknown AutoEP preset", tensor=name, found=family)
            logical = autoep_router_name(
                family, layer_name, preset.router_pattern, rest[len("router.gate.") :]
            )
            shape = _full_param_shape(p)
            layout = single_layout(name, shape)
            return layout, {0: ZeroGroup(self.table[0])}, 0, plain_parts(logical, shape)
        raise UnsupportedLayoutError(
            "a parameter of an AutoEP layer other than its router and packed experts (shared experts are not "
            "described)",
            tensor=name,
        )


def _check_expert_layers(reader: _Reader) -> None:
    for layer_name, layer in reader.autoep.items():
        params = list(layer.experts.named_parameters())
        kinds = {_zero3_param(p) for _, p in params}
        if len(kinds) > 1:
            raise UnsupportedLayoutError(
                "an AutoEP layer mixes ZeRO-3 and non-ZeRO-3 expert parameters",
                tensor=layer_name,
                rank=reader.rank,
                found={n: _zero3_param(p) for n, p in params},
            )


def _check_zero3(name: str, p: Any, group: ZeroGroup, rank: int, allow_gathered: bool = False) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if not _zero3_param(p):
        raise UnsupportedLayoutError("a parameter that ZeRO-3 does not partition", tensor=name, rank=rank)
    if not allow_gathered and (p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.numel() != 0):
        raise UnsupportedLayoutError(
            "a gathered ZeRO-3 parameter is a derived copy; maps describe its partition only (release it "
            "first, e.g. leave GatheredParameters or call engine.empty_partition_cache())",
            tensor=name,
            rank=rank,
            expected="ds_status NOT_AVAILABLE",
            found=f"{p.ds_status.name}, param.data {tuple(p.shape)}",
        )
    if getattr(p, "ds_secondary_tensor", None) is not None:
        raise UnsupportedLayoutError("a ZeRO++ hpZ secondary partition", tensor=name, rank=rank)
    if hasattr(p.ds_tensor, "ds_quant_scale"):
        raise UnsupportedLayoutError("a quantized ZeRO-3 partition", tensor=name, rank=rank)
    final = getattr(p.ds_tensor, "final_location", None)
    if final is not None and "nvme" in str(final).lower():
        raise UnsupportedLayoutError(
            "an NVMe-offloaded ZeRO-3 partition", tensor=name, rank=rank, found=final
        )
    got = _ranks(p.ds_process_group)
    if got != group.ranks:
        raise LayoutError(
            "the parameter's ZeRO-3 storage group does not match its group table",
            tensor=name,
            rank=rank,
            expected=group.ranks,
            found=got,
        )
    n = int(p.ds_numel)
    expected = -(-n // len(group.ranks))
    if p.ds_tensor.numel() != expected or int(getattr(p.ds_tensor, "ds_numel", expected)) != expected:
        raise LayoutError(
            "ds_tensor's size differs from ZeRO-3's even partitioning",
            tensor=name,
            rank=rank,
            expected=f"ceil({n} / {len(group.ranks)}) = {expected}",
            found=p.ds_tensor.numel(),
        )


def _offset_in(view: torch.Tensor, base: torch.Tensor, *, name: str, rank: int) -> int:
    """Element offset of ``view``'s first element inside ``base`` (the same memory), or a refusal."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        raise LayoutError("a parameter is not a view of its flat buffer", tensor=name, rank=rank)
    diff = view.data_ptr() - base.data_ptr()
    size = base.element_size()
    if diff % size or not view.is_contiguous():
        raise LayoutError(
            "a parameter view is not element-aligned and contiguous in its buffer", tensor=name, rank=rank
        )
    return diff // size


@dataclass
class _FlatGroup:
    params: list[torch.nn.Parameter]  # flat order
    flat: torch.Tensor
    hp: torch.Tensor
    ranks: tuple[int, ...]
    param_alignment: int
    hp_source: Callable[[], Any]


def _entry(engine: Any, attribute: str, index: int) -> Callable[[], Any]:
    """Fetches ``engine.optimizer.<attribute>[index]`` as it is when called."""

    def source() -> Any:
        return getattr(engine.optimizer, attribute)[index]

    return source


def _flat_groups(reader: _Reader) -> list[_FlatGroup]:
    opt = reader.opt
    out = []
    if type(opt).__name__ == "BF16_Optimizer":
        for g, params in enumerate(opt.bf16_groups):
            out.append(
                _FlatGroup(
                    list(params),
                    opt.bf16_groups_flat[g],
                    opt.fp32_groups_flat_partition[g],
                    _ranks(opt.real_dp_process_group[g]),
                    1,
                    _entry(reader.engine, "fp32_groups_flat_partition", g),
                )
            )
        return out
    for g, params in enumerate(opt.round_robin_bit16_groups):
        flat = opt.bit16_groups_flat[g]
        out.append(
            _FlatGroup(
                list(params),
                flat,
                opt.single_partition_of_fp32_groups[g],
                _ranks(opt.real_dp_process_group[g]),
                param_alignment_for(flat.element_size(), bool(opt.parameter_alignment)),
                _entry(reader.engine, "single_partition_of_fp32_groups", g),
            )
        )
    return out


def _attribute(obj: Any, attribute: str) -> Callable[[], Any]:
    def source() -> Any:
        return getattr(obj, attribute, None)

    return source


def _itself(obj: Any) -> Callable[[], Any]:
    return lambda: obj


def read_engine(engine: Any, *, allow_gathered: bool = False) -> ReadEngine:
    """Layout facts of ``engine`` and this rank's own buffers; raises the refusals of
    ``rollout_sync.trainer.refusals`` and of this module before anything moves.

    ``allow_gathered`` accepts ZeRO-3 parameters that are gathered (persistent parameters stay gathered
    after the first forward): for re-deriving views during training, where the views are of the partitions
    (``ds_tensor``) DeepSpeed steps and re-gathers from. A first description refuses them."""
    refuse_engine(read_traits(engine))
    reader = _Reader(engine)
    _check_expert_layers(reader)
    stage = reader.stage
    rank = reader.rank

    named = list(engine.module.named_parameters())
    placements: dict[str, tuple[Layout, dict[int, ZeroGroup], int, tuple[LogicalPart, ...]]] = {}
    local: dict[str, LocalParam] = {}
    param_dtypes = set()
    for name, p in named:
        layout, zero, own, parts = reader.placement(name, p)
        placements[name] = (layout, zero, own, parts)
        shard = layout.shards.get(own)
        local_shape = _full_param_shape(p)
        if shard is None or tuple(shard.shape) != local_shape:
            raise ShapeMismatchError(
                "this rank's parameter differs from its placement shard",
                tensor=name,
                rank=rank,
                expected=None if shard is None else shard.shape,
                found=local_shape,
            )
        param_dtypes.add(p.dtype)
        if stage == 3:
            _check_zero3(name, p, zero[own], rank, allow_gathered)
            k = zero[own].ranks.index(rank)
            local[name] = LocalParam(
                name, own, p.ds_tensor, -k * p.ds_tensor.numel(), lp_source=_attribute(p, "ds_tensor")
            )
        else:
            if _zero3_param(p):
                raise UnsupportedLayoutError(
                    "a ZeRO-3 parameter in a ZeRO-0/1/2 engine", tensor=name, rank=rank
                )
            if rank not in zero[own].ranks:
                raise LayoutError(
                    "this rank is not in its own ZeRO group", tensor=name, rank=rank, expected=zero[own].ranks
                )
            data = p.data
            if not data.is_contiguous():
                raise LayoutError("a parameter that is not contiguous", tensor=name, rank=rank)
            local[name] = LocalParam(name, own, data.reshape(-1), 0, lp_source=_itself(p))
    if len(param_dtypes) > 1:
        raise UnsupportedLayoutError(
            "parameters of several dtypes",
            expected="one dtype",
            found=sorted(_dtype(d) for d in param_dtypes),
        )
    param_dtype = _dtype(next(iter(param_dtypes))) if param_dtypes else "bfloat16"

    master_dtype: str | None = None
    by_id = {id(p): name for name, p in named}
    if stage in (1, 2):
        master_dtype = _zero12_positions(reader, by_id, placements, local)
    elif stage == 3:
        master_dtype = _zero3_positions(reader, by_id, placements, local)

    params = []
    for name, _ in named:
        layout, zero, _, parts = placements[name]
        trainable = stage == 0 or local[name].hp is not None
        params.append(ParamFacts(name, tuple(layout.shape), layout, zero, parts, trainable))
    facts = TrainerFacts(stage, param_dtype, master_dtype, tuple(params))
    basic = getattr(reader.opt, "optimizer", None) if stage > 0 else None

    def basic_now() -> Any:
        return getattr(engine.optimizer, "optimizer", None) if stage > 0 else None

    return ReadEngine(facts, local, basic, rank, basic_now)


def _zero12_positions(
    reader: _Reader,
    by_id: dict[int, str],
    placements: dict[str, tuple[Layout, dict[int, ZeroGroup], int, tuple[LogicalPart, ...]]],
    local: dict[str, LocalParam],
) -> str | None:
    rank = reader.rank
    dtypes = set()
    for fg in _flat_groups(reader):
        names = []
        for p in fg.params:
            name = by_id.get(id(p))
            if name is None:
                raise LayoutError("an optimizer parameter the module does not name", rank=rank)
            names.append(name)
        if not names:
            continue
        own = {placements[n][2] for n in names}
        keys = {tuple(sorted(placements[n][0].shards)) for n in names}
        if len(own) != 1 or len(keys) != 1:
            raise LayoutError(
                "one flat buffer holds parameters of different placements",
                tensor=names[0],
                rank=rank,
                found=sorted(own),
            )
        own_k = own.pop()
        for n in names:
            if placements[n][1][own_k].ranks != fg.ranks:
                raise LayoutError(
                    "the parameter's ZeRO-1/2 storage group does not match its group table",
                    tensor=n,
                    rank=rank,
                    expected=placements[n][1][own_k].ranks,
                    found=fg.ranks,
                )
        dp = len(fg.ranks)
        for k in keys.pop():
            numels = [prod(placements[n][0].shards[k].shape) for n in names]
            offsets, total = zero12_flat_layout(numels, dp, param_alignment=fg.param_alignment)
            if k == own_k:
                actual = [
                    _offset_in(p.data, fg.flat, name=n, rank=rank)
                    for n, p in zip(names, fg.params, strict=True)
                ]
                if actual != list(offsets) or fg.flat.numel() != total or fg.hp.numel() != total // dp:
                    raise LayoutError(
                        "DeepSpeed's flat buffer differs from the ZeRO-1/2 layout rule",
                        tensor=names[0],
                        rank=rank,
                        expected=(offsets, total, total // dp),
                        found=(tuple(actual), fg.flat.numel(), fg.hp.numel()),
                    )
            for n, o in zip(names, offsets, strict=True):
                zero = placements[n][1]
                zero[k] = ZeroGroup(zero[k].ranks, o, total)
        i = fg.ranks.index(rank)
        part = total // dp
        for n in names:
            o = placements[n][1][own_k].flat_offset or 0
            local[n].hp = fg.hp
            local[n].hp_shift = o - i * part
            local[n].hp_source = fg.hp_source
        dtypes.add(fg.hp.dtype)
    if len(dtypes) > 1:
        raise UnsupportedLayoutError(
            "master weights of several dtypes", found=sorted(_dtype(d) for d in dtypes)
        )
    return _dtype(dtypes.pop()) if dtypes else None


def _zero3_positions(
    reader: _Reader,
    by_id: dict[int, str],
    placements: dict[str, tuple[Layout, dict[int, ZeroGroup], int, tuple[LogicalPart, ...]]],
    local: dict[str, LocalParam],
) -> str | None:
    opt = reader.opt
    rank = reader.rank
    dtypes = set()
    for sg, params in enumerate(opt.fp16_groups):
        lp_flat = opt.fp16_partitioned_groups_flat[sg]
        hp_flat = opt.fp32_partitioned_groups_flat[sg]
        offset = 0
        for p in params:
            name = by_id.get(id(p))
            if name is None:
                raise LayoutError("an optimizer parameter the module does not name", rank=rank)
            if lp_flat is None or _offset_in(p.ds_tensor, lp_flat, name=name, rank=rank) != offset:
                raise LayoutError(
                    "ds_tensor is not at its place in the ZeRO-3 flat partition buffer",
                    tensor=name,
                    rank=rank,
                    expected=offset,
                )
            lp = local[name]
            lp.hp = hp_flat
            lp.hp_shift = offset + lp.lp_shift
            lp.hp_source = _entry(reader.engine, "fp32_partitioned_groups_flat", sg)
            offset += p.ds_tensor.numel()
        if hp_flat.numel() != offset:
            raise LayoutError(
                "ZeRO-3 fp32 partition buffer differs from its parameters' partitions",
                rank=rank,
                expected=offset,
                found=hp_flat.numel(),
            )
        dtypes.add(hp_flat.dtype)
    if len(dtypes) > 1:
        raise UnsupportedLayoutError(
            "master weights of several dtypes", found=sorted(_dtype(d) for d in dtypes)
        )
    return _dtype(dtypes.pop()) if dtypes else None


def flat_view(buffer: torch.Tensor, start: int, stop: int, shift: int, shape: Sequence[int]) -> torch.Tensor:
    """``buffer[start + shift : stop + shift]`` viewed with ``shape`` (a view, never a copy)."""
    if stop == start:
        return buffer.reshape(-1)[:0].view(tuple(shape))
    lo = start + shift
    hi = stop + shift
    if lo < 0 or hi > buffer.numel():
        raise LayoutError(
            "a storage view runs outside its buffer", expected=f"[0, {buffer.numel()})", found=f"[{lo}, {hi})"
        )
    return buffer.reshape(-1)[lo:hi].view(tuple(shape))
