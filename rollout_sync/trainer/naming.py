"""Logical names: which logical tensors (names and shapes as ``save_pretrained`` writes them) a trainer
parameter holds, and where in the parameter. Pure.

- A plain parameter is one logical tensor of its own name and full shape. Tied parameters appear once,
  under the first name ``named_parameters`` gives (``model.embed_tokens.weight``).
- transformers 5.19 keeps a Qwen3-MoE layer's experts fused in memory (``experts.gate_up_proj [E, 2I, H]``,
  ``experts.down_proj [E, H, I]``) but saves per-expert keys: ``experts.{e}.gate_proj.weight =
  gate_up_proj[e, :I]``, ``up_proj = gate_up_proj[e, I:]``, ``down_proj = down_proj[e]``
  (``fused_expert_parts``).
- AutoEP replaces a MoE block by a layer whose router is ``{block}.router.gate`` and whose experts are
  packed ``w1`` (gate), ``w3`` (up) ``[E_local, I, H]`` and ``w2`` (down) ``[E_local, H, I]``. Over the full
  expert axis ``[E, ...]`` expert ``e`` of ``w1`` is ``{block}.experts.{e}.gate_proj.weight`` and so on
  (``autoep_expert_parts``); the router weight is ``{block}.{router}.weight`` with the preset's router name
  (``gate`` for Qwen3-MoE) (``autoep_router_name``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UnsupportedLayoutError
from .facts import LogicalPart

__all__ = [
    "EXPERT_KEYS",
    "autoep_expert_parts",
    "autoep_router_name",
    "fused_expert_parts",
    "plain_parts",
]

EXPERT_KEYS: dict[str, dict[str, str]] = {
    # AutoEP model family -> packed parameter -> per-expert module name in the saved checkpoint.
    "qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}


def plain_parts(name: str, shape: Sequence[int]) -> tuple[LogicalPart, ...]:
    """The parameter is one logical tensor of its own name and shape."""
    shape = tuple(shape)
    return (LogicalPart(name, shape, (0,) * len(shape), shape),)


def fused_expert_parts(block: str, param: str, shape: Sequence[int]) -> tuple[LogicalPart, ...]:
    """Logical tensors of transformers' fused ``{block}.experts.gate_up_proj [E, 2I, H]`` (``param`` =
    ``"gate_up_proj"``) or ``{block}.experts.down_proj [E, H, I]`` (``"down_proj"``)."""
    shape = tuple(shape)
    if len(shape) != 3:
        raise UnsupportedLayoutError("fused experts are 3-D", tensor=f"{block}.experts.{param}", found=shape)
    experts, rows, cols = shape
    parts: list[LogicalPart] = []
    for e in range(experts):
        prefix = f"{block}.experts.{e}"
        if param == "gate_up_proj":
            if rows % 2:
                raise UnsupportedLayoutError(
                    "fused gate/up rows are not two halves", tensor=f"{block}.experts.{param}", found=shape
                )
            half = rows // 2
            parts.append(LogicalPart(f"{prefix}.gate_proj.weight", (half, cols), (e, 0, 0), (1, half, cols)))
            parts.append(LogicalPart(f"{prefix}.up_proj.weight", (half, cols), (e, half, 0), (1, half, cols)))
        elif param == "down_proj":
            parts.append(LogicalPart(f"{prefix}.down_proj.weight", (rows, cols), (e, 0, 0), (1, rows, cols)))
        else:
            raise UnsupportedLayoutError(
                "unknown fused expert parameter",
                tensor=f"{block}.experts.{param}",
                expected="gate_up_proj or down_proj",
                found=param,
            )
    return tuple(parts)


def autoep_expert_parts(
    family: str, block: str, packed: str, shape: Sequence[int]
) -> tuple[LogicalPart, ...]:
    """Logical tensors of AutoEP's packed ``{block}.experts.{packed}`` (``w1``/``w2``/``w3``) over the full
    expert axis, ``shape = [E, ...]``."""
    shape = tuple(shape)
    keys = EXPERT_KEYS.get(family)
    if keys is None or packed not in keys:
        raise UnsupportedLayoutError(
            "no checkpoint key names known for this AutoEP model family",
            tensor=f"{block}.experts.{packed}",
            expected=sorted(EXPERT_KEYS),
            found=family,
        )
    rest = shape[1:]
    zeros = (0,) * len(rest)
    return tuple(
        LogicalPart(f"{block}.experts.{e}.{keys[packed]}.weight", rest, (e, *zeros), (1, *rest))
        for e in range(shape[0])
    )


def autoep_router_name(family: str, block: str, router: str, param: str) -> str:
    """The saved name of an AutoEP router parameter ``{block}.router.gate.{param}``: the preset's router
    module name ``router`` (``gate`` for Qwen3-MoE) in place of ``router.gate``."""
    if family not in EXPERT_KEYS or not router.isidentifier():
        raise UnsupportedLayoutError(
            "no checkpoint key names known for this AutoEP router",
            tensor=f"{block}.router.gate.{param}",
            expected=sorted(EXPERT_KEYS),
            found=(family, router),
        )
    return f"{block}.{router}.{param}"
