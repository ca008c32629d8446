"""The rollout side inside one vLLM worker: its target maps, its derived copies and its weight updates.

Layers vLLM keeps in another form than their loaded form (packed, quantized, removed weights:
``vllm_plugin.loaded_form``) are probed and written in their loaded form, one layer at a time, and rebuilt
by vLLM's post-load processing as each completes.

``RolloutWorker`` is a plain object built from the worker's model and config. The worker extension and the
weight-transfer engine are thin shells around it (they import vLLM, this module touches vLLM only through
the model object and the two helpers it calls: the probe and the derived-copy finder).

Global ranks: an engine's workers are numbered in TP-rank order from the ``first_rank`` given at setup
(rollout ranks come after trainer ranks; engines one after another).

No generation may run while weights are written. Inside one ``collective_rpc`` this holds by construction
(the engine core runs utility calls between steps). An update spread over several calls (``begin`` ...
``finish``, as vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) must be
bracketed by the caller with vLLM's pause (``/pause`` ... ``/resume`` on a server, which also clears the
prefix cache); should a forward run anyway while an update is open, a forward pre-hook raises instead of
generating from half-written weights. The hook is a safety net, not the mechanism: a replayed CUDA graph
runs no Python hook.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rollout_sync.errors import IncompleteUpdateError, UnsupportedLayoutError
from rollout_sync.layout.dtypes import dtype_name
from rollout_sync.rollout.apply import covered_ranges, uncovered_ranges, write_pieces
from rollout_sync.rollout.checkpoint import logical_tensors, read_tensors
from rollout_sync.rollout.codec import local_targets_to_dict
from rollout_sync.rollout.landing_maps import DEFAULT_MAX_PIECES
from rollout_sync.rollout.local_targets import LocalTargets, fallback_map
from rollout_sync.rollout.update import DerivedCopy, UpdateSession

from .loaded_form import LoadedForms

__all__ = ["RolloutWorker", "param_digest"]


def param_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, dtype and shape (bit-for-bit comparison across processes)."""
    data = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    if data.numel():
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _model_checkpoint_dir(vllm_config: Any) -> Path:
    path = Path(str(vllm_config.model_config.model))
    if path.is_dir():
        return path
    raise ValueError(
        f"the engine's model {str(path)!r} is not a local directory; pass the logical tensors "
        "(name -> shape) to setup explicitly"
    )


class RolloutWorker:
    """Target maps and weight updates of one vLLM worker."""

    def __init__(
        self,
        model: torch.nn.Module,
        targets: LocalTargets,
        derived: Sequence[DerivedCopy],
        *,
        tp_rank: int,
        setup_report: Mapping[str, Any],
        fallback_dtype: str,
        shapes: Mapping[str, tuple[int, ...]],
        loaded_forms: LoadedForms | None = None,
        storages: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        # Storages that are not model parameters (an adapter's LoRA slot buffers and staging tensors).
        self.storages = dict(storages or {})
        # The LoRA adapter (rank, scaling) whose A and B the targets are, if any (told at the handshake).
        self.adapter: dict[str, Any] | None = None
        self.loaded_forms = loaded_forms if loaded_forms else None
        self.record_loaded = False
        self.loaded_digests: dict[str, str] = {}
        self.fallback_dtype = fallback_dtype
        self.shapes = dict(shapes)
        self.targets = targets
        self.derived = list(derived)
        self.tp_rank = tp_rank
        self.setup_report = dict(setup_report)
        self.session: UpdateSession | None = None
        self.updates = 0
        self._guard: Any = None

    @property
    def rank(self) -> int:
        return self.targets.rank

    @classmethod
    def setup(
        cls,
        model: torch.nn.Module,
        vllm_config: Any,
        *,
        tp_rank: int,
        first_rank: int,
        tensors: Mapping[str, Sequence[int]] | None = None,
        max_pieces: int = DEFAULT_MAX_PIECES,
        maps: str = "fast",
    ) -> RolloutWorker:
        """Learn this worker's targets (``maps``: ``"fast"``, ``"probe"`` or ``"verify"``, see
        ``vllm_plugin.worker_maps``). ``tensors``: logical tensor name -> shape; by default every tensor of the
        checkpoint the engine was started from."""
        from .derived import derived_copies
        from .loaded_form import LoadedForms
        from .worker_maps import find_targets

        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise UnsupportedLayoutError(
                "pipeline parallel vLLM engines are not supported",
                expected="pipeline_parallel_size 1",
                found=parallel.pipeline_parallel_size,
            )
        if first_rank < 0:
            raise ValueError(f"first_rank must be >= 0, found {first_rank}")
        if tensors is None:
            shapes = {n: s for n, (s, _) in logical_tensors(_model_checkpoint_dir(vllm_config)).items()}
        else:
            shapes = {str(n): tuple(int(x) for x in s) for n, s in tensors.items()}
        forms = LoadedForms.find(model)
        model_dtype = dtype_name(vllm_config.model_config.dtype)
        with forms.probing():  # transformed layers in their loaded form while the loaders are read
            targets, report = find_targets(
                model,
                vllm_config,
                shapes,
                rank=first_rank + tp_rank,
                tp_rank=tp_rank,
                max_pieces=max_pieces,
                maps=maps,
            )
        forms.bind(targets.views)  # refuses a layer that cannot be rebuilt from what the plan delivers
        derived = derived_copies(model, targets.views)
        return cls(
            model,
            targets,
            derived,
            tp_rank=tp_rank,
            setup_report=report,
            fallback_dtype=model_dtype,
            shapes=shapes,
            loaded_forms=forms,
        )

    @classmethod
    def setup_adapter(
        cls,
        model: torch.nn.Module,
        model_runner: Any,
        vllm_config: Any,
        spec: Mapping[str, Any],
        *,
        tp_rank: int,
        first_rank: int,
    ) -> RolloutWorker:
        """Targets of a LoRA adapter's A and B in a slot this worker holds for it (``spec``: see
        ``vllm_plugin.lora_slots.AdapterSpec``) instead of the model's weights."""
        from .lora_slots import AdapterSlot, AdapterSpec

        started = time.perf_counter()
        shapes = {n: s for n, (s, _) in logical_tensors(_model_checkpoint_dir(vllm_config)).items()}
        adapter = AdapterSpec.from_dict(spec)
        held = AdapterSlot.hold(model_runner, adapter, shapes, rank=first_rank + tp_rank)
        worker = cls(
            model,
            held.targets,
            held.derived,
            tp_rank=tp_rank,
            setup_report={"seconds": time.perf_counter() - started, "adapter": dict(spec), "slot": held.slot},
            fallback_dtype=dtype_name(vllm_config.model_config.dtype),
            shapes={n: m.shape for n, m in held.targets.maps.items()},
            storages=held.storages,
        )
        worker.adapter = {"rank": adapter.rank, "scaling": adapter.scaling}
        return worker

    def force_fallback(self, names: Sequence[str], reason: str) -> None:
        """Take ``names`` through the full-tensor path on this rank too (a map's boxes must agree across
        ranks, so a tensor refused on one rank is staged whole on every rank). Rebuilds the derived-copy
        list, whose padding ranges depend on the views."""
        from .derived import derived_copies

        if self.session is not None:
            raise IncompleteUpdateError(f"rank {self.rank}: cannot change targets while an update is open")
        maps = dict(self.targets.maps)
        views = dict(self.targets.views)
        refused = dict(self.targets.refused)
        for name in names:
            if name in refused:
                continue
            shape = self.shapes.get(name)
            if shape is None:
                raise KeyError(f"rank {self.rank}: no logical tensor {name!r}")
            maps[name], views[name] = fallback_map(name, shape, self.fallback_dtype, self.rank)
            refused[name] = reason
        self.targets = LocalTargets(self.rank, maps, views, refused, self.targets.absent)
        self.derived = derived_copies(self.model, views)

    # ------------------------------------------------------------------------------------------ reports

    def summary(self) -> dict[str, Any]:
        """JSON-able facts about this worker's targets."""
        in_place = [n for n, v in self.targets.views.items() if v.param is not None]
        forms = self.loaded_forms
        loaded = {name: forms.loaded_bytes(name) for name in forms.layers} if forms is not None else {}
        return {
            "loaded_form_layers": len(loaded),
            "largest_layer_loaded_bytes": max(loaded.values(), default=0),
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "in_place": len(in_place),
            "refused": dict(self.targets.refused),
            "absent": list(self.targets.absent),
            "derived": [d.name for d in self.derived],
            "probe_seconds": self.setup_report.get("probe_seconds", 0.0),
            "maps_seconds": self.setup_report.get("seconds", 0.0),
            "setup": dict(self.setup_report),
        }

    def local_targets_dict(self) -> dict[str, Any]:
        return local_targets_to_dict(self.targets)

    def params(self) -> dict[str, torch.Tensor]:
        return {**{n: p.data for n, p in self.model.named_parameters()}, **self.storages}

    def uncovered(self) -> dict[str, list[tuple[int, int]]]:
        """Per parameter holding some storage, the flat ranges no storage covers (padding)."""
        views = list(self.targets.views.values())
        forms = self.loaded_forms
        out = {}
        for name, data in self.params().items():
            if forms is not None and forms.layer_of(name) is not None:
                continue  # a loaded form: made at each sync with its uncovered elements zeroed
            covered = covered_ranges(views, name)
            if covered:
                out[name] = uncovered_ranges(data.numel(), covered)
        return out

    def param_digests(self) -> dict[str, str]:
        return {n: param_digest(t) for n, t in self.params().items()}

    # ------------------------------------------------------------------------------------------ updates

    def begin(self, atomic: bool = False) -> UpdateSession:
        """Open a weight update; forwards raise until ``finish`` or ``abort``. ``atomic``: nothing is
        written into the weights before ``finish`` (``UpdateSession``)."""
        if self.session is not None:
            raise IncompleteUpdateError(f"rank {self.rank}: a weight update is already open")

        def load_full(staged: Sequence[tuple[str, torch.Tensor]]) -> None:
            with torch.no_grad():
                self.model.load_weights(list(staged))  # type: ignore[operator]

        self.session = UpdateSession(
            self.rank,
            self.targets.views,
            {n: m.dtype for n, m in self.targets.maps.items()},
            self.params(),
            self.derived,
            load_full,
            self.loaded_forms,
            self._record_loaded if self.record_loaded else None,
            atomic=atomic,
        )
        rank = self.rank

        def refuse_forward(module: torch.nn.Module, args: Any) -> None:
            raise IncompleteUpdateError(
                f"rank {rank}: a forward pass ran while a weight update is open (pause generation first)"
            )

        self._guard = self.model.register_forward_pre_hook(refuse_forward)
        return self.session

    def _record_loaded(self, layer: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Digest a completed layer's loaded form before vLLM processes it (what the sync wrote)."""
        for name, t in tensors.items():
            self.loaded_digests[name] = param_digest(t)

    def _close(self) -> None:
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self.session = None

    def finish(self) -> dict[str, Any]:
        """Load refused tensors through ``load_weights``, rebuild derived copies, close the update."""
        if self.session is None:
            raise IncompleteUpdateError(f"rank {self.rank}: finish without an open weight update")
        session = self.session
        try:
            refreshed = session.finish()
        finally:
            self._close()
        self.updates += 1
        return {"rank": self.rank, "written": len(session.written), "refreshed": refreshed}

    def abort(self) -> None:
        """Close an open update without completing it (the weights may be inconsistent; a layer kept in
        another form that was written in part keeps its old weights)."""
        if self.session is not None:
            self.session.abort()
        self._close()

    def write_checkpoint(self, path: str, names: Sequence[str] | None = None) -> int:
        """Inside an open update, write tensors of a checkpoint (every tensor this rank holds by default)
        through this rank's maps; returns the elements written. Aborts the update on failure."""
        session = self.session
        if session is None:
            raise IncompleteUpdateError(f"rank {self.rank}: no weight update is open")
        views = self.targets.views
        wanted = [n for n in (names if names is not None else views) if n in views]
        try:
            elements = 0
            with torch.no_grad():
                for name, full in read_tensors(path, wanted):
                    storage = session.storage(name)
                    elements += write_pieces(storage, self.targets.maps[name].ranks[self.rank], full)
                    session.mark_written(name)
        except BaseException:
            self.abort()
            raise
        return elements

    def apply_checkpoint(self, path: str, names: Sequence[str] | None = None) -> dict[str, Any]:
        """Open an update, write a checkpoint through the maps, finish. One call: no generation can
        interleave."""
        started = time.perf_counter()
        self.begin()
        elements = self.write_checkpoint(path, names)
        report = self.finish()
        report["elements"] = elements
        report["seconds"] = time.perf_counter() - started
        return report
