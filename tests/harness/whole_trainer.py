"""A trainer of one rank that holds every tensor of a checkpoint whole (no DeepSpeed), for handshake and
sync tests driven from the test process (``TrainerSync.connect``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.rollout.checkpoint import read_tensors
from rollout_sync.trainer.hook import TrainerSync

#: The tensors whose rows are the vocabulary (``grow`` adds rows to them).
VOCAB_TENSORS = ("lm_head.weight", "model.embed_tokens.weight")


def whole_sources(
    checkpoint: Path, grow: int = 0, grown: Sequence[str] = VOCAB_TENSORS
) -> tuple[list[TensorMap], dict[str, torch.Tensor]]:
    """(maps, storages) of rank 0 holding every tensor of ``checkpoint`` whole, row-major; ``grow`` zero
    rows appended to each of ``grown`` (a model with a larger vocabulary than the engine's)."""
    maps, sources = [], {}
    for name, t in read_tensors(checkpoint, None):
        t = t.contiguous()
        if grow and name in grown:
            t = torch.cat([t, torch.zeros(grow, *t.shape[1:], dtype=t.dtype)])
        shape = tuple(t.shape)
        piece = Piece(Box((0,) * len(shape), shape), 0, row_major_strides(shape), (0,))
        dtype = str(t.dtype).removeprefix("torch.")
        maps.append(TensorMap(name, shape, dtype, {0: RankStorage(shape, (piece,))}))
        sources[name] = t
    return maps, sources


def connect_whole_trainer(
    checkpoint: Path, address: str, *, engines: int, token: str, timeout: float, grow: int = 0
) -> TrainerSync:
    """Join (and coordinate) a handshake at ``address`` as the only trainer rank, holding ``checkpoint``
    whole (``whole_sources``); blocks until every engine has joined, or raises the coordinator's refusal."""
    maps, sources = whole_sources(checkpoint, grow)
    return TrainerSync.connect(
        maps, sources, rank=0, world_size=1, address=address, engines=engines, token=token, timeout=timeout
    )
