"""The rollout side, independent of vLLM: target maps from the model's shapes (``shape_targets``), their
check against traces of vLLM's loaders (``check``), target maps from loader-probe observations (``probe``),
a fleet's merged and coverage-checked targets (``targets``), their plain-data form (``codec``), the logical
tensors of a checkpoint (``checkpoint``) and in-place writes into storage views with derived-copy rebuilds
(``apply``)."""

from .apply import DerivedCopy, UpdateSession, piece_view, storage_tensor, write_pieces, write_segment
from .probe import Landing, LocalTargets, StorageView, local_targets, target_map

__all__ = [
    "DerivedCopy",
    "Landing",
    "LocalTargets",
    "StorageView",
    "UpdateSession",
    "local_targets",
    "piece_view",
    "storage_tensor",
    "target_map",
    "write_pieces",
    "write_segment",
]
