"""What a sender of delta syncs keeps of what it sent (``delta``).

- ``Shadow``: every message of a ``DeltaProgram`` as this rank last sent it, in one byte buffer (the bytes
  this rank sends per sync); a delta sync compares each message with it, a full sync refills it.
- ``message_runs``: what a delta sync compares with a message's shadow, copy by copy: on CPU the source
  storage itself where it holds the wire's bit patterns (no packing), else the copy packed into the staging
  slot.
- the sample (``take_sample``, ``changed_share``): every ``SAMPLE_STRIDE``-th element of each source storage
  this rank sends from, in the wire dtype; before the agreement, the share of it that changed tells whether a
  delta is worth asking for.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

import torch

from ...planning.half import PlanHalf
from ..core.pair_messages import Message, wire_dtype
from ..core.program import PartProgram, pack, torch_dtype, view
from .change_codec import bits_dtype
from .compare import Run
from .packed_program import DeltaProgram

__all__ = ["SAMPLE_STRIDE", "Shadow", "changed_share", "message_runs", "take_sample"]

SAMPLE_STRIDE = 1024
"""The sample a sender keeps: every 1024th element of each source storage it sends from (denser in small
ones)."""


class Shadow:
    """What this rank last sent in every message of a delta program (see the module docstring)."""

    def __init__(self, delta: DeltaProgram, device: torch.device) -> None:
        self.layout = delta.layout
        self.buffer = torch.zeros(delta.shadow_bytes, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def of(self, delta: DeltaProgram, m: Message) -> torch.Tensor:
        at = delta.shadow_at[(m.peer, m.round)]
        return self.buffer[at : at + m.nbytes]

    def refill(self, delta: DeltaProgram, sources: Mapping[str, torch.Tensor]) -> None:
        """Pack every message into the shadow (after a full sync: what it sent)."""
        for entries in delta.program.sends.values():
            for m, parts in entries:
                if (m.peer, m.round) in delta.shadow_at:
                    pack(self.of(delta, m), parts, sources)


def message_runs(
    shadow: torch.Tensor,
    buf: torch.Tensor,
    parts: tuple[PartProgram, ...],
    sources: Mapping[str, torch.Tensor],
) -> list[Run] | None:
    """A message's elements as runs to compare (``delta.compare``): each copy's new elements straight from
    its source storage where they are its bit patterns already (same dtype, CPU, a strided view NumPy can
    read: 1-D contiguous or 2-D with contiguous rows), else packed into ``buf`` first (cast to the wire
    dtype); against the same elements of ``shadow`` (the message as last sent). None off CPU."""
    if shadow.device.type != "cpu" or buf.device.type != "cpu":
        return None
    itemsize = parts[0].wire_size
    bits = bits_dtype(itemsize)
    old_all = shadow.view(bits).numpy()
    runs = []
    for p in parts:
        storage = sources[p.name]
        typed = buf[p.byte_offset : p.byte_offset + p.count * p.wire_size].view(p.wire)
        base = p.byte_offset // itemsize
        for c in p.copies:
            n = prod(c.extent)
            at = base + c.buffer_offset
            source = _readable(view(storage, c)) if storage.dtype == p.wire and storage.is_cpu else None
            if source is None:
                packed = typed[c.buffer_offset : c.buffer_offset + n]
                packed.view(c.extent).copy_(view(storage, c))
                source = packed
            new = source.view(bits).numpy()
            runs.append(Run(new, old_all[at : at + n].reshape(new.shape), at))
    runs.sort(key=lambda r: r.at)
    return runs


def _readable(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as 1-D contiguous or 2-D with contiguous rows (a view), else None."""
    while t.dim() > 1 and t.shape[0] == 1:
        t = t[0]
    if t.is_contiguous():
        return t.view(-1)
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    return None


def _sampled_names(half: PlanHalf) -> dict[str, torch.dtype]:
    """The source storages this rank sends from, with the dtype each travels in."""
    out = {}
    for segment in half.sends:
        t = half.tensors[segment.tensor]
        out[t.name] = torch_dtype(wire_dtype(t.source_dtype, t.target_dtype))
    return out


def take_sample(half: PlanHalf, sources: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ``SAMPLE_STRIDE``-th element of each contiguous source storage this rank sends from, cast to the
    dtype it travels in (a change is a change of what the receiver holds)."""
    return {
        name: _sampled(sources[name]).to(wire).clone()
        for name, wire in _sampled_names(half).items()
        if sources[name].is_contiguous()
    }


def _sampled(storage: torch.Tensor) -> torch.Tensor:
    """Every ``SAMPLE_STRIDE``-th element of a contiguous storage, denser in small ones (at least 64 samples
    where it has them): a view."""
    return storage.view(-1)[:: max(1, min(SAMPLE_STRIDE, storage.numel() // 64))]


def changed_share(
    sample: Mapping[str, torch.Tensor], half: PlanHalf, sources: Mapping[str, torch.Tensor]
) -> float:
    """The share of the sampled elements whose bits differ from ``sample`` (taken at the last sync)."""
    changed = total = 0
    for name, old in sample.items():
        new = _sampled(sources[name]).to(old.dtype)
        bits = bits_dtype(old.element_size())
        changed += int(torch.count_nonzero(new.view(bits) != old.view(bits)))
        total += old.numel()
    return changed / total if total else 0.0
