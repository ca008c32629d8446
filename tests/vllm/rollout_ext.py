"""Test-only additions to the rollout worker extension, loaded into real vLLM workers by the rollout tests
(``worker_extension_cls="tests.vllm.rollout_ext.RolloutTestExtension"``). Everything here is a test tool,
named as such, never used by the product:

- ``rs_rollout_test_scale_loader``: replaces one parameter's weight loader by one that scales what it
  copies, i.e. a *transforming* loader (as a quantizing loader would be), to check that it is refused;
- ``rs_rollout_test_fill_uncovered`` / ``rs_rollout_test_uncovered_values``: write a sentinel into every
  element no storage view covers (padding) and read those elements back, to check that a sync never
  writes them;
- ``rs_rollout_test_apply_segments``: a local stand-in for the transport: applies the receive segments of
  a plan whose single source rank holds each logical tensor whole (read from a checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollout_sync.rollout.apply import write_segment
from rollout_sync.rollout.checkpoint import read_tensors
from vllm_plugin.extension import RolloutSyncExtension

ROLLOUT_TEST_EXTENSION = "tests.vllm.rollout_ext.RolloutTestExtension"


class RolloutTestExtension(RolloutSyncExtension):
    model_runner: Any

    def rs_rollout_test_scale_loader(self, param_name: str, factor: float) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        param = dict(self.model_runner.model.named_parameters())[param_name]
        original = getattr(param, "weight_loader", default_weight_loader)

        def scaled(p: torch.Tensor, w: torch.Tensor) -> None:
            original(p, w * factor)

        param.weight_loader = scaled

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
