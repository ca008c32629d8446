"""AutoTP and AutoEP placements read from a live DeepSpeed 0.19.8 engine: which TP or EP rank holds which
shard of each parameter, the ZeRO group that stores each shard, and the logical tensors in it.

Everything is read locally (no collective); facts about other ranks follow from DeepSpeed's rules, checked
against this rank's own groups:

- AutoTP (``_init_tp_mesh_device``): a ``(data_parallel, tensor_parallel)`` mesh, global rank ``d·tp + t``;
  each parameter's TP placement is the affine map AutoTP attached to it (an untouched parameter is
  replicated over TP); each TP rank's shard is ZeRO-stored over its DP group ``[t, tp + t, ...]``;
- AutoEP (``_create_expert_and_data_parallel``, no model parallelism): EP groups are consecutive ranks,
  EP rank ``r % ep``; the expert-data-parallel (EDP) group of EP rank ``k`` is ``[k, k + ep, ...]``; the
  expert placement is the descriptor AutoEP attached to each packed parameter.

The layouts come from the pure builders of ``rollout_sync.trainer.placement``, the logical tensors from
``rollout_sync.trainer.naming``. Flat positions inside ZeRO's buffers are added later
(``rollout_sync.trainer.zero_positions``).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch
import torch.distributed as tdist

from ...errors import LayoutError, UnsupportedLayoutError
from ...layout.shards import Layout
from ..facts import LogicalPart, ZeroGroup
from ..naming import autoep_expert_parts, autoep_router_name, fused_expert_parts, plain_parts
from ..placement import autoep_layout, autotp_layout, replicated_layout, single_layout
from .parts import autoep_layers, full_param_shape, group_ranks

__all__ = ["AUTOEP_META", "AUTOTP_META", "ParamPlacement", "PlacementReader"]

AUTOTP_META = "ds_autotp_universal_checkpoint_meta"
AUTOEP_META = "ds_autoep_uc_meta"

ParamPlacement: TypeAlias = tuple[Layout, dict[int, ZeroGroup], int, tuple[LogicalPart, ...]]
"""A parameter's placement, the ZeRO group of each shard (keyed by placement rank; flat positions not yet
known), this rank's own placement rank, and the logical tensors the parameter holds."""


class PlacementReader:
    """This rank's TP/DP mesh and expert groups, checked against DeepSpeed's own, and the placement of each
    parameter (``placement``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rank = int(tdist.get_rank())
        self.world = int(tdist.get_world_size())
        self.tp = max(int(engine.autotp_size() or 1), 1)
        self.autoep = autoep_layers(engine.module)
        self._groups()

    # -- groups ------------------------------------------------------------------------------------
    def _groups(self) -> None:
        from deepspeed.utils import groups

        dp_group = self.engine.seq_data_parallel_group
        self.dp_ranks = group_ranks(dp_group) if dp_group is not None else tuple(range(self.world))
        tp = self.tp
        if self.world % tp:
            raise LayoutError(
                "world size is not a multiple of the AutoTP size", expected=tp, found=self.world
            )
        dp = self.world // tp
        self.table = tuple(tuple(d * tp + t for d in range(dp)) for t in range(tp))
        if tp > 1:
            tp_ranks = group_ranks(groups.get_tensor_model_parallel_group())
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
    def placement(self, name: str, p: torch.nn.Parameter) -> ParamPlacement:
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
            layout = replicated_layout(name, full_param_shape(p), self.tp)
        else:
            layout = single_layout(name, full_param_shape(p))
        zero = {k: ZeroGroup(self.table[k]) for k in layout.shards}
        shape = tuple(layout.shape)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and len(shape) == 3:
            if getattr(p, "is_transposed", False):
                raise UnsupportedLayoutError("transposed fused experts", tensor=name, found="is_transposed")
            parts = fused_expert_parts(block.rsplit(".", 1)[0], name.rsplit(".", 1)[1], shape)
        else:
            parts = plain_parts(name, shape)
        return layout, zero, self.tp_rank, parts

    def _autoep_param(self, name: str, p: torch.nn.Parameter, layer_name: str) -> ParamPlacement:
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
            shape = full_param_shape(p)
            layout = single_layout(name, shape)
            return layout, {0: ZeroGroup(self.table[0])}, 0, plain_parts(logical, shape)
        raise UnsupportedLayoutError(
            "a parameter of an AutoEP layer other than its router and packed experts (shared experts are not "
            "described)",
            tensor=name,
        )
