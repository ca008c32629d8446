"""The check of a half before the agreement: is it well formed for its rank? Pure (no torch).

``check_half`` looks only at what the half itself says (segment roles, addresses inside the storage shapes
of the plan's tensor table, known dtypes) and returns the reason for a refusal rather than raising, so that
a rank that cannot run still joins the agreement and every rank stops together. The local storages are
checked by ``local_check``.
"""

from __future__ import annotations

from math import prod

from ...layout.box import reach
from ...layout.dtypes import ITEMSIZE
from ...planning.half import PlanHalf

__all__ = ["check_half"]


def check_half(half: PlanHalf) -> str | None:
    """Why this half cannot be executed by its rank, or None. Checks only what the half itself says
    (segment roles, addresses inside the storage shapes of the plan's tensor table, known dtypes); the
    local storages are checked by the executor."""
    rank = half.rank
    n = len(half.tensors)
    for t in half.tensors:
        for dtype in (t.source_dtype, t.target_dtype):
            if dtype not in ITEMSIZE:
                return f"tensor {t.name!r} has dtype {dtype!r}, which the transport does not know"
    roles = (
        ("sent", half.sends, lambda s: s.source_rank == rank != s.target_rank),
        ("received", half.receives, lambda s: s.target_rank == rank != s.source_rank),
        ("local", half.local, lambda s: s.source_rank == rank == s.target_rank),
    )
    for role, segments, belongs in roles:
        for s in segments:
            if not 0 <= s.tensor < n:
                return f"a {role} segment names tensor index {s.tensor}, the plan has {n} tensors"
            t = half.tensors[s.tensor]
            where = f"tensor {t.name!r}, {role} segment {s.source_rank}->{s.target_rank} extent {s.extent}"
            if not belongs(s):
                return f"{where} does not belong to the {role} segments of rank {rank}"
            if len(s.source_strides) != len(s.extent) or len(s.target_strides) != len(s.extent):
                return f"{where}: strides {s.source_strides}/{s.target_strides} do not match the extent"
            if any(e < 0 for e in s.extent) or min((*s.source_strides, *s.target_strides, 0)) < 0:
                return f"{where}: negative extent or stride"
            if s.source_offset < 0 or s.target_offset < 0:
                return f"{where}: negative offset"
            sides = []
            if role in ("sent", "local"):
                sides.append(("source", t.source_storage, s.source_rank, s.source_offset, s.source_strides))
            if role in ("received", "local"):
                sides.append(("target", t.target_storage, s.target_rank, s.target_offset, s.target_strides))
            for side, storages, owner, offset, strides in sides:
                shape = storages.get(owner)
                if shape is None:
                    return f"{where}: the plan lists no {side} storage on rank {owner}"
                end = reach(offset, s.extent, strides)
                if end > prod(shape):
                    return (
                        f"{where}: reaches {side} element {end - 1}, the {side} storage on rank {owner}"
                        f" has shape {tuple(shape)} ({prod(shape)} elements)"
                    )
    return None
