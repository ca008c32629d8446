"""DeepSpeed 0.19.8's ZeRO-1/2 flat-buffer geometry, as pure functions of parameter sizes.

``DeepSpeedZeroOptimizer`` (``runtime/zero/stage_1_and_2.py``) and ``BF16_Optimizer``
(``runtime/bf16_optimizer.py``) flatten each optimizer group's trainable parameters into one buffer:

- in flat order (the group's order, or the round-robin order with ``round_robin_gradients``: parameter
  ``j`` goes to bucket ``j % dp`` and the buckets are concatenated);
- each parameter but the last followed by padding up to a multiple of ``param_alignment`` elements
  (``16 // gcd(16, element_size)`` with ``zero_optimization.parameter_alignment``, else 1; always 1 for
  ``BF16_Optimizer``);
- the whole padded to a multiple of ``2 · dp`` (``nccl_start_alignment_factor · dp``), and cut into ``dp``
  equal partitions; group rank ``i`` keeps the fp32 master weights and optimizer states of partition ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd

from ..errors import LayoutError

__all__ = ["param_alignment_for", "round_robin_order", "zero12_flat_layout"]

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
