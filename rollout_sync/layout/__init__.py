"""Pure description of storage layouts: boxes, pieces, maps and flat runs. No process group, no torch
distributed, no vLLM or DeepSpeed import."""

from .box import Box, row_major_strides
from .maps import Piece, RankStorage, TensorMap
from .runs import flat_run_boxes

__all__ = ["Box", "Piece", "RankStorage", "TensorMap", "flat_run_boxes", "row_major_strides"]
