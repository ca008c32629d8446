"""Delta syncs without a group (``transport.nixl_delta``), in one process: trainer ranks code each sync into
their exports, workers read their rows and regions as NIXL would (bytes copied from the export) and apply
them; every target equals the trainer's weights bit for bit after every sync, and a delta moves a small
share of a full sync's bytes."""

from __future__ import annotations

import pytest
import torch

from rollout_sync.errors import WireFormatError
from rollout_sync.geometry.model_maps import trainer_maps, vllm_target_maps
from rollout_sync.planning.planner import plan_model
from rollout_sync.shapes import model_tensors
from rollout_sync.transport.core.target_streams import Targets
from rollout_sync.transport.delta.nixl_export import (
    TABLE_BYTES,
    DeltaExport,
    apply_region,
    delta_program,
    export_buffer,
    read_table,
)
from testbed.expected_storage import extract
from tests.harness.session_model import CONFIG, TRAINERS, WORKERS, full_tensors, step_tensors

MESSAGE_BYTES = 4096
WORKER_RANKS = list(range(TRAINERS, TRAINERS + WORKERS))


class Rig:
    """ZeRO-3 on two trainer ranks, vLLM TP 2: the trainer ranks' exports and the workers' targets."""

    def __init__(self, capacity: int) -> None:
        model = model_tensors(CONFIG)
        self.sources_maps = trainer_maps(model, 3, TRAINERS)
        self.targets_maps = vllm_target_maps(model, 1, WORKERS, first_rank=TRAINERS)
        self.plan = plan_model(self.sources_maps, self.targets_maps)
        self.exports = {
            r: DeltaExport(self.plan.half(r), MESSAGE_BYTES, export_buffer(capacity)) for r in range(TRAINERS)
        }
        self.programs = {w: delta_program(self.plan.half(w), MESSAGE_BYTES) for w in WORKER_RANKS}
        self.targets: dict[int, dict[str, torch.Tensor]] = {w: {} for w in WORKER_RANKS}
        self.full: dict[str, torch.Tensor] = {}

    def sources(self, r: int) -> dict[str, torch.Tensor]:
        return {m.name: extract(self.full[m.name], m, r) for m in self.sources_maps if r in m.ranks}

    def expected(self, w: int) -> dict[str, torch.Tensor]:
        return {m.name: extract(self.full[m.name], m, w).clone() for m in self.targets_maps if w in m.ranks}

    def sync(self, full: dict[str, torch.Tensor], seq: int, readers: set[int]) -> dict[int, int | None]:
        """Every trainer rank codes; each reader applies its rows where all of them are there with its
        base (else it takes its whole half, as the full pull does). The bytes each reader read from the
        regions (None: a full pull)."""
        self.full = full
        for r, export in self.exports.items():
            export.code(self.sources(r), readers, seq)
        read: dict[int, int | None] = {}
        for w in sorted(readers):
            rows = {r: read_table(e.buffer).get(w) for r, e in self.exports.items()}
            if not self.targets[w] or any(
                row is None or row.base != seq - 1 or row.seq != seq for row in rows.values()
            ):
                self.targets[w] = self.expected(w)
                read[w] = None
                continue
            sink = Targets(self.targets[w], None, self.plan.half(w), self.programs[w].program)
            read[w] = 0
            for r, row in rows.items():
                assert row is not None and row.offset >= TABLE_BYTES
                region = self.exports[r].buffer[row.offset : row.offset + row.nbytes].clone()
                apply_region(self.programs[w], r, region, sink, w)
                read[w] += row.nbytes
        return read

    def check(self, readers: set[int]) -> None:
        for w in readers:
            expected = self.expected(w)
            for name, t in self.targets[w].items():
                assert torch.equal(t.view(torch.int16), expected[name].view(torch.int16)), (w, name)


def _full_bytes(rig: Rig, w: int) -> int:
    return sum(t.numel() * t.element_size() for t in rig.expected(w).values())


def test_a_delta_sync_lands_bit_for_bit_and_reads_a_small_share_of_a_full_sync():
    rig = Rig(capacity=1 << 20)
    full = full_tensors(7)
    everyone = set(WORKER_RANKS)
    assert rig.sync(full, 1, everyone) == {w: None for w in WORKER_RANKS}  # no base yet: full pulls
    rig.check(everyone)
    for seq in (2, 3):
        full = step_tensors(full, 0.01, seq)
        read = rig.sync(full, seq, everyone)
        rig.check(everyone)
        for w in WORKER_RANKS:
            assert read[w] is not None and 0 < read[w] < 0.1 * _full_bytes(rig, w), (w, read[w])
    same = rig.sync(full, 4, everyone)  # nothing changed: heads only
    rig.check(everyone)
    assert all(n is not None and n < 2048 for n in same.values()), same


def test_most_of_it_changed_means_full_pulls_until_a_sync_refills_the_shadows_then_deltas_again():
    rig = Rig(capacity=1 << 20)
    full = full_tensors(3)
    everyone = set(WORKER_RANKS)
    rig.sync(full, 1, everyone)
    full = step_tensors(full, 0.5, 2)  # the sample says half changed: no coding, no refill
    assert rig.sync(full, 2, everyone) == {w: None for w in WORKER_RANKS}
    assert all(e.share is not None and e.share > 0.3 for e in rig.exports.values())
    full = step_tensors(full, 0.01, 3)  # worth a delta again: this sync refills the shadows (a full pull)
    assert rig.sync(full, 3, everyone) == {w: None for w in WORKER_RANKS}
    full = step_tensors(full, 0.01, 4)
    assert all(n is not None for n in rig.sync(full, 4, everyone).values())
    rig.check(everyone)


def test_an_export_too_small_or_a_reader_away_means_a_full_pull_for_it_bit_for_bit():
    small = Rig(capacity=256)  # not even the heads fit
    full = full_tensors(4)
    everyone = set(WORKER_RANKS)
    small.sync(full, 1, everyone)
    for seq in (2, 3):
        full = step_tensors(full, 0.01, seq)
        assert small.sync(full, seq, everyone) == {w: None for w in WORKER_RANKS}
        small.check(everyone)
    rig = Rig(capacity=1 << 20)
    rig.sync(full, 1, everyone)
    away = WORKER_RANKS[1]
    full = step_tensors(full, 0.01, 2)
    rig.sync(full, 2, everyone - {away})
    full = step_tensors(full, 0.01, 3)
    back = rig.sync(full, 3, everyone)  # the reader that was away has no base at the trainer ranks
    assert back[away] is None and back[WORKER_RANKS[0]] is not None, back
    rig.check(everyone)
    full = step_tensors(full, 0.01, 4)
    assert all(n is not None for n in rig.sync(full, 4, everyone).values())
    rig.check(everyone)


def test_a_region_whose_head_does_not_fit_its_message_is_refused():
    rig = Rig(capacity=1 << 20)
    full = full_tensors(5)
    everyone = set(WORKER_RANKS)
    rig.sync(full, 1, everyone)
    rig.sync(step_tensors(full, 0.01, 2), 2, everyone)
    w = WORKER_RANKS[0]
    row = read_table(rig.exports[0].buffer)[w]
    region = rig.exports[0].buffer[row.offset : row.offset + row.nbytes].clone()
    region[:16].view(torch.int64)[:] = torch.tensor([1, 1 << 30])  # coded, a billion bytes
    sink = Targets(rig.targets[w], None, rig.plan.half(w), rig.programs[w].program)
    with pytest.raises(WireFormatError, match="does not fit message"):
        apply_region(rig.programs[w], 0, region, sink, w)
