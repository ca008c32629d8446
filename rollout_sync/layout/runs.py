"""Flat runs of an N-D block as N-D boxes.

ZeRO stores a tensor (or a TP shard of it) flattened and cut into contiguous runs. A run ``[start, stop)``
of the row-major flattening of ``shape`` is the union of at most ``2·ndim − 1`` boxes: a ragged head that
completes the innermost axes, a block of whole slabs, and a ragged tail. Describing runs this way keeps maps
small (never one piece per row).
"""

from __future__ import annotations

from math import prod

from .box import Box, row_major_strides


def flat_run_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes, in flat order, whose union is the flat run ``[start, stop)`` of a row-major ``shape``.

    Consecutive boxes are contiguous in flat order, so the i-th box starts at flat position
    ``start + sum(numel of boxes before it)``. At most ``2 * len(shape) - 1`` boxes (one for a 0-D shape).
    """
    total = prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(
            f"flat run [{start}, {stop}) is not inside a tensor of shape {shape} ({total} elements)"
        )
    if start == stop:
        return []
    ndim = len(shape)
    if ndim == 0:
        return [Box((), ())]
    strides = row_major_strides(shape)
    return _run(shape, strides, 0, (), start, stop)


def _run(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    axis: int,
    prefix: tuple[int, ...],
    start: int,
    stop: int,
) -> list[Box]:
    """Boxes of the flat run [start, stop) inside the sub-block fixed by ``prefix`` (coordinates of the
    leading axes, each with extent 1); start and stop are relative to that sub-block's first element."""
    if start == stop:
        return []
    ones = (1,) * len(prefix)
    rest = shape[axis + 1 :]
    stride = strides[axis]
    first, first_off = divmod(start, stride)
    last, last_off = divmod(stop, stride)
    if first == last:
        # The whole run lies inside one slab along this axis.
        return _run(shape, strides, axis + 1, (*prefix, first), first_off, last_off)
    boxes: list[Box] = []
    if first_off:
        boxes += _run(shape, strides, axis + 1, (*prefix, first), first_off, stride)
        first += 1
    if last > first:
        boxes.append(Box((*prefix, first) + (0,) * len(rest), (*ones, last - first, *rest)))
    if last_off:
        boxes += _run(shape, strides, axis + 1, (*prefix, last), 0, last_off)
    return boxes
