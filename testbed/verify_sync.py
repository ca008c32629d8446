"""After a sync: does vLLM hold exactly the trainer's weights? (examples and tests; not the product)

Every training process gathers the trainer's weights with DeepSpeed itself (not through rollout-sync's
maps; collective), process 0 writes them as a checkpoint, and each process has its vLLM side write that
checkpoint through vLLM's own loader maps (``RolloutSide.changed_by``): if the sync was exact, not one bit
of any vLLM parameter changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["verify_last_sync"]


def verify_last_sync(sync: Any, model_dir: str | Path, out: str | Path) -> tuple[bool, list[str]]:
    """``sync``: a ``rollout_sync.integrations.weight_sync.WeightSync`` after a sync. Returns whether every
    process found its engines unchanged, and this process's changed parameter names."""
    import torch.distributed as dist

    from .checkpoints import full_logical_tensors, save_checkpoint, save_merged

    version = sync.history[-1].version
    path = Path(out) / f"v{version}"
    if getattr(sync.engine.module, "peft_config", None):  # a PEFT model syncs merged: PEFT's own merge
        save_merged(sync.engine, model_dir, path)
    else:
        full = full_logical_tensors(sync.engine)
        if dist.get_rank() == 0:
            save_checkpoint(full, model_dir, path)
    dist.barrier()
    changed = sync.rollout.changed_by(str(path))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, not changed)
    return all(every), changed
