"""Byte buffers reused from one layer's loaded form to the next, and from one sync to the next.

A sync into layers an engine keeps in another form makes every such layer's loaded form, writes it, lets
the engine rebuild its own form from it and drops it (``TransientLayers``). Allocating and freeing those
buffers for each layer of each sync left the C allocator's heaps fragmented: a vLLM worker's resident
memory grew by 127 MB at its first sync and by up to 21 MB at later ones (Qwen3-0.6B shapes, TP 2, an AMX
CPU), with no more tensors alive. A ``BufferPool`` hands out byte buffers by size and takes them back when
nothing else refers to their storage, so that the loaded forms of a model's layers (a few distinct sizes)
live in the same memory at every sync.

- ``take(nbytes, device)``: a free buffer of exactly that size, or a new one.
- ``give_back(buf)``: keeps it for the next ``take`` of its size (or frees it, when the pool keeps one of
  that size already: at most one buffer per size is kept), but only once nothing else refers to its
  storage: a kernel's form made as a view of a loaded form must not be overwritten by the next one (such a
  buffer is ``forget``-ten and stays the kernel's).
- ``held_bytes``: what it keeps now, free and handed out; memory held between syncs, reported as such.
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool"]


def _uses(buf: torch.Tensor) -> int:
    """References to ``buf``'s storage: every tensor viewing it holds one."""
    return int(torch._C._storage_Use_Count(buf.untyped_storage()._cdata))


class BufferPool:
    def __init__(self) -> None:
        self._free: dict[tuple[int, str], torch.Tensor] = {}
        self._out: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (buffer, its storage's uses when taken)
        self.allocations = 0

    def take(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on ``device`` (its contents are whatever it held last)."""
        key = (int(nbytes), str(torch.device(device)))
        buf = self._free.pop(key, None)
        if buf is None:
            buf = torch.empty(key[0], dtype=torch.uint8, device=device)
            self.allocations += 1
        self._out[id(buf)] = (buf, _uses(buf))
        return buf

    def give_back(self, buf: torch.Tensor) -> bool:
        """Take back a buffer ``take`` handed out, once nothing but the pool refers to its storage; whether
        it was taken back (False: something still views it; ask again later, or ``forget`` it). The pool
        keeps it for the next ``take`` of its size unless it keeps one of that size already."""
        out = self._out.get(id(buf))
        if out is None:
            raise ValueError("this buffer was not handed out by this pool")
        if _uses(buf) != out[1]:
            return False
        del self._out[id(buf)]
        self._free.setdefault((buf.numel(), str(buf.device)), buf)
        return True

    def forget(self, buf: torch.Tensor) -> None:
        """Stop tracking a handed-out buffer that stays in use elsewhere (a kernel's form viewing it)."""
        self._out.pop(id(buf), None)

    def missing_bytes(self, sizes: list[tuple[int, str]]) -> int:
        """The bytes ``take`` would allocate for buffers of these ``(nbytes, device)`` sizes, now."""
        free = set(self._free)
        missing = 0
        for key in sizes:
            if key in free:
                free.discard(key)
            else:
                missing += key[0]
        return missing

    @property
    def held_bytes(self) -> int:
        """The bytes of every buffer the pool keeps or has handed out."""
        free = sum(b.numel() for b in self._free.values())
        return free + sum(b.numel() for b, _ in self._out.values())
