"""Observations of a loader probe (pure: numpy arrays in, no vLLM, no torch).

A *loader probe* (``vllm_plugin.probing``) feeds vLLM's own ``load_weights`` one logical tensor at a time,
filled with its coordinates along one dimension (values ``1..n``, never 0), into parameters whose data were
swapped for ``-1``-filled float32 tensors, and reads back which element of which parameter received which
logical element. That observation is a ``Landing``, built a probed dimension and a chunk at a time by
``LandingBuilder``, which checks as it goes that the loader only copies. ``landing_maps`` turns the
landings of one rank into that rank's part of the target map.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from ..errors import LayoutError, NotAffineError
from ..layout.box import row_major_strides

__all__ = ["CHUNK", "FILLED", "HOLE", "Landing", "LandingBuilder"]

HOLE = -2  # ``Landing.linear``: the loader wrote nothing at this position
FILLED = -1  # ``Landing.linear``: the loader wrote zeros here (padding rows of a vocab shard)
CHUNK = 1 << 21  # elements handled at once when scanning a landing (bounds temporaries to a few dozen MB)
_EMPTY_PROBE = -1.0  # what a probe buffer holds where the loader wrote nothing


@dataclass(frozen=True)
class Landing:
    """What one probe observed: elements of one logical tensor written into one parameter.

    The observation covers the *window* ``[start, start + len(linear))`` of the parameter's row-major
    flattening (``param_shape``), from its first to its last written element: ``linear[i]`` is the
    row-major linear index, in the logical tensor, of the element found at position ``start + i``, or
    ``FILLED`` where the loader wrote zeros (padding), or ``HOLE`` where it wrote nothing. One integer per
    element of the window (int32 when the tensor has under 2**31 elements), built a chunk at a time by
    ``LandingBuilder``: a 77.8M-element vocab shard costs 311 MB, not the gigabytes of per-element
    coordinate arrays.
    """

    param: str
    param_shape: tuple[int, ...]
    param_contiguous: bool
    start: int
    linear: np.ndarray  # (window,) int32 or int64


def linear_dtype(shape: tuple[int, ...]) -> type[np.signedinteger]:
    """The integer type of ``Landing.linear`` for a logical tensor of this shape."""
    return np.int32 if prod(shape) < 2**31 else np.int64


class LandingBuilder:
    """Builds one ``Landing`` from the probe values seen in one parameter's window, one probed dimension
    and one chunk at a time, checking as it goes that the loader only copies (pure: numpy arrays in).

    ``add(dim, offset, values)`` takes the probe values found at window positions ``offset ...`` when
    dimension ``dim`` was probed (``-1`` where nothing was written); dimension 0 first. A value that is not
    a coordinate (1..n along ``dim``), a zero where other probes wrote a coordinate, or an element written
    for one dimension's probe and not another's raises ``NotAffineError``: the loader transforms values or
    places them by value. ``written_outside(dim, count)`` reports elements written outside the window
    (there must be none: the window comes from dimension 0).
    """

    def __init__(
        self,
        tensor: str,
        shape: tuple[int, ...],
        rank: int,
        *,
        param: str,
        param_shape: tuple[int, ...],
        param_contiguous: bool,
        start: int,
        stop: int,
    ) -> None:
        self.tensor = tensor
        self.shape = tuple(shape)
        self.rank = rank
        self.param = param
        self.param_shape = tuple(param_shape)
        self.param_contiguous = param_contiguous
        self.start = start
        self.linear = np.full(stop - start, HOLE, dtype=linear_dtype(self.shape))
        self.strides = row_major_strides(self.shape)
        self.done: list[int] = []  # dimensions fully added, in order

    def _error(self, reason: str, found: str) -> NotAffineError:
        limits = f"integers 1..{list(self.shape)} per dimension" if self.shape else "the value 1"
        return NotAffineError(
            reason, tensor=self.tensor, rank=self.rank, expected=f"probe coordinates: {limits}", found=found
        )

    def add(self, dim: int, offset: int, values: np.ndarray) -> None:
        values = np.asarray(values).reshape(-1)
        cur = self.linear[offset : offset + values.shape[0]]
        if cur.shape[0] != values.shape[0]:
            raise LayoutError(
                "probe values run past the window",
                tensor=self.tensor,
                rank=self.rank,
                expected=f"at most {self.linear.shape[0] - offset} values at offset {offset}",
                found=values.shape[0],
            )
        hole = values == _EMPTY_PROBE
        zero = values == 0
        if dim == 0:
            cur[zero] = FILLED
            data = ~(hole | zero)
        else:
            if not np.array_equal(hole, cur == HOLE):
                i = int(np.argmax(hole != (cur == HOLE)))
                raise self._error(
                    f"probing dimension {dim} wrote other elements than probing dimension 0: the loader's "
                    "placement depends on the values (it transforms them)",
                    f"element {self.start + offset + i} of parameter {self.param!r}",
                )
            if not np.array_equal(zero, cur == FILLED):
                i = int(np.argmax(zero != (cur == FILLED)))
                raise self._error(
                    "the loader zeroes some probes of an element and not others: it transforms values",
                    f"element {self.start + offset + i} of parameter {self.param!r}",
                )
            data = cur >= 0
        got = values[data]
        limit = self.shape[dim] if self.shape else 1
        bad = (got != np.round(got)) | (got < 1) | (got > limit)
        if bad.any():
            i = int(np.flatnonzero(data)[int(np.argmax(bad))])
            raise self._error(
                "the loader transforms values (quantization, scaling, arithmetic): a probe value is not a "
                "coordinate",
                f"{float(values[i])} for dimension {dim} at element {self.start + offset + i} of parameter "
                f"{self.param!r}",
            )
        stride = self.strides[dim] if self.shape else 0
        term = (got.astype(self.linear.dtype) - 1) * self.linear.dtype.type(stride)
        if dim == 0:
            cur[data] = term
        else:
            cur[data] += term

    def dimension_done(self, dim: int) -> None:
        if dim != len(self.done):
            raise LayoutError(
                "probe dimensions out of order",
                tensor=self.tensor,
                rank=self.rank,
                expected=len(self.done),
                found=dim,
            )
        self.done.append(dim)

    def written_outside(self, dim: int, count: int) -> None:
        if count:
            raise self._error(
                f"probing dimension {dim} wrote elements outside the range probing dimension 0 wrote: the "
                "loader's placement depends on the values (it transforms them)",
                f"{count} elements of parameter {self.param!r}",
            )

    def landing(self) -> Landing:
        if len(self.done) != max(len(self.shape), 1):
            raise LayoutError(
                "a landing was finished before every dimension was probed",
                tensor=self.tensor,
                rank=self.rank,
                expected=max(len(self.shape), 1),
                found=len(self.done),
            )
        return Landing(self.param, self.param_shape, self.param_contiguous, self.start, self.linear)
