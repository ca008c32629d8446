"""Where the loaded forms of layers vLLM keeps in another form live while a sync writes them.

vLLM's ``materialize_layer`` allocates each tensor of a layer's loaded form anew (``torch.empty_strided``);
after the rebuild the loaded form is freed. Done for every layer at every sync, that fragmented the C
allocator's heaps (a worker's resident memory grew by 127 MB at its first sync, Qwen3-0.6B shapes at TP 2
on an AMX CPU). ``LayerMemory.materialize`` does what ``materialize_layer`` does (same tensor classes and
attributes, on the layer's restore device) but puts each tensor in a buffer of a ``BufferPool``, and
``release`` hands a rebuilt layer's buffers back, so the loaded forms of every layer of a model share a few
buffers (one per distinct size), held from one sync to the next (``held_bytes``).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_sync.layout.box import reach
from rollout_sync.rollout.buffer_pool import BufferPool

__all__ = ["LayerMemory"]

Size = tuple[int, str]  # (bytes, device)


def _extent_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor of ``t``'s size and strides spans (0 when empty)."""
    return reach(0, t.size(), t.stride()) * t.element_size()


def _meta() -> Any:
    from vllm.model_executor.model_loader.reload import meta

    return meta


class LayerMemory:
    def __init__(self) -> None:
        self.pool = BufferPool()
        self._lent: dict[str, list[torch.Tensor]] = {}  # open layer -> the buffers its loaded form is in
        self._returned: list[torch.Tensor] = []  # buffers of rebuilt layers, not yet taken back
        self._sizes: dict[str, list[Size]] = {}

    def sizes(self, name: str, info: Any) -> list[Size]:
        """The buffers layer ``name``'s loaded form needs (``info``: its vLLM reload record)."""
        got = self._sizes.get(name)
        if got is None:
            skip = _meta().SKIP_TENSORS
            params, buffers = info.restore_metadata
            device = str(torch.device(info.restore_device))
            tensors = [t for n, t in (params | buffers).items() if n not in skip]
            got = self._sizes[name] = [(_extent_bytes(t), device) for t in tensors]
        return got

    def materialize(self, name: str, module: torch.nn.Module, info: Any) -> None:
        """``materialize_layer`` for layer ``name`` (restored on meta), its tensors in pool buffers."""
        meta = _meta()
        if module.__class__.__name__ in meta.SKIP_MODULES:
            return
        self.settle()
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        lent = self._lent.setdefault(name, [])
        device = torch.device(info.restore_device)
        for tname, tensor in get_layer_tensors(module).items():
            if tname in meta.SKIP_TENSORS or not tensor.is_meta:
                continue
            buf = self.pool.take(_extent_bytes(tensor), device)
            lent.append(buf)
            made = buf.view(tensor.dtype).as_strided(tuple(tensor.size()), tuple(tensor.stride()))
            made.__class__ = tensor.__class__
            made.__dict__ = tensor.__dict__.copy()
            setattr(module, tname, made)

    def release(self, name: str) -> None:
        """Layer ``name`` was rebuilt (or put back unprocessed): its buffers go back to the pool as soon as
        nothing else views them."""
        self._returned += self._lent.pop(name, [])

    def settle(self, *, forget_busy: bool = False) -> None:
        """Take back the released buffers nothing views any more; with ``forget_busy`` (between syncs), the
        others are left to whatever still views them (a kernel's form made as a view of its loaded form)."""
        busy = [buf for buf in self._returned if not self.pool.give_back(buf)]
        if forget_busy:
            for buf in busy:
                self.pool.forget(buf)
            busy = []
        self._returned = busy

    @property
    def held_bytes(self) -> int:
        """The memory the pool holds: buffers of open layers, released ones and those kept for reuse."""
        return self.pool.held_bytes

    def adds_bytes(self, name: str, info: Any) -> int:
        """The memory materializing layer ``name`` would allocate now."""
        return self.pool.missing_bytes(self.sizes(name, info))
