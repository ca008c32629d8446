"""Pure helpers of the whole-sync benchmark: the /proc status parser, the kernel peak-memory measurement,
and the assembly of one method's figures and one JSON row."""

from __future__ import annotations

import json

import pytest

from benchmarks.sync import assemble_row, method_summary
from testbed.peak_memory import PeakMemory, parse_status_kib

STATUS = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n"


def test_status_values_are_read_in_bytes():
    assert parse_status_kib(STATUS, "VmRSS") == 1024 * 1024
    assert parse_status_kib(STATUS, "VmHWM") == 2048 * 1024


def test_a_missing_status_key_is_refused():
    with pytest.raises(KeyError, match="VmSwap"):
        parse_status_kib(STATUS, "VmSwap")


def test_a_status_line_in_other_units_is_refused():
    with pytest.raises(ValueError, match="VmRSS"):
        parse_status_kib("VmRSS:\t1 MB\n", "VmRSS")


def test_a_block_that_touches_64_mib_measures_at_least_that_much_extra():
    memory = PeakMemory().start()
    block = bytearray(64 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    extra = memory.stop()
    del block
    assert memory.method in ("VmHWM", "sampled")
    assert 60 << 20 <= extra < 256 << 20


def test_a_block_that_allocates_nothing_measures_little_extra():
    memory = PeakMemory().start()
    total = sum(range(1000))
    assert total == 499500
    assert memory.stop() < 8 << 20


def _reports(extras: list[int], sent: list[int]) -> list[dict[str, int]]:
    return [{"extra_bytes": e, "bytes_sent": s} for e, s in zip(extras, sent, strict=True)]


def test_a_method_reports_the_median_time_and_the_largest_extra_memory_per_side():
    summary = method_summary(
        [3.0, 1.0, 2.0],
        [_reports([10, 30], [100, 50]), _reports([20, 5], [100, 50]), _reports([1, 1], [100, 50])],
        [_reports([7, 9], [0, 0]), _reports([70, 0], [0, 0]), _reports([8, 8], [0, 0])],
    )
    assert summary["seconds"] == 2.0
    assert summary["trainer_extra_bytes"] == 30
    assert summary["rollout_extra_bytes"] == 70
    assert summary["bytes_moved"] == 150


def test_the_staging_a_rank_holds_across_syncs_counts_as_extra_memory():
    trainer = [[{"extra_bytes": 10, "bytes_sent": 1, "peak_staging_bytes": 1000}]]
    workers = [[{"extra_bytes": 7, "stats": {"peak_staging_bytes": 500}}]]
    summary = method_summary([1.0], trainer, workers)
    assert summary["trainer_extra_bytes"] == 1010 and summary["rollout_extra_bytes"] == 507
    assert summary["trainer_staging_bytes"] == 1000 and summary["rollout_staging_bytes"] == 500
    row = assemble_row("zero3", summary, summary, ours_equal=True, baseline_equal=True, staging_cap_bytes=64)
    assert row["ours_staging_bytes"] == 1000


def test_a_method_without_one_report_per_sync_is_refused():
    with pytest.raises(ValueError, match="one trainer and one worker report"):
        method_summary([1.0, 2.0], [_reports([1], [1])], [_reports([1], [1])])


def test_a_row_has_the_issue_fields_and_serializes_to_json():
    ours = {
        "seconds": 1.0,
        "all_seconds": [1.0],
        "trainer_extra_bytes": 5,
        "rollout_extra_bytes": 6,
        "bytes_moved": 7,
    }
    base = {
        "seconds": 4.0,
        "all_seconds": [4.0],
        "trainer_extra_bytes": 50,
        "rollout_extra_bytes": 60,
        "bytes_moved": 70,
    }
    row = assemble_row("zero3", ours, base, ours_equal=True, baseline_equal=False, staging_cap_bytes=64)
    for key in (
        "trainer",
        "ours_s",
        "baseline_s",
        "ours_trainer_extra_bytes",
        "baseline_trainer_extra_bytes",
        "ours_rollout_extra_bytes",
        "baseline_rollout_extra_bytes",
        "ours_bytes_moved",
        "baseline_bytes_moved",
        "bitwise_equal",
    ):
        assert key in row
    assert row["speedup"] == 4.0
    assert row["bitwise_equal"] is True and row["baseline_bitwise_equal"] is False
    assert json.loads(json.dumps({"rows": [row]}))["rows"][0] == row
