"""The agreement records and the decision every rank takes from them (pure: no process group)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.errors import PlanMismatchError
from rollout_sync.planning.plan import Plan
from rollout_sync.planning.records import PlannedTensor, Segment
from rollout_sync.transport.core.agreement import (
    RECORD_BYTES,
    Record,
    decide,
    decode,
    delta_base,
    digest_sha,
    encode,
)
from rollout_sync.transport.core.fingerprint import pair_sums, table_hash


def _plan() -> Plan:
    t = PlannedTensor("w", (4, 4), "float32", "bfloat16", {0: (16,), 1: (16,)}, {1: (4, 4), 2: (4, 4)})
    segments = [
        Segment(0, 0, 0, (4, 1), 2, 0, (4, 1), (4, 4)),
        Segment(0, 1, 0, (4, 1), 1, 0, (4, 1), (4, 4)),
        Segment(0, 0, 0, (4, 1), 1, 0, (4, 1), (2, 4)),
    ]
    return Plan([t], segments)


def _record(plan: Plan, rank: int, **changes: object) -> Record:
    half = plan.half(rank)
    sent, received = pair_sums(half)
    record = Record(
        group_rank=rank,
        half_rank=rank,
        refused=False,
        zero_copy=True,
        overlap=True,
        digest_sha=digest_sha(half.digest),
        digest_prefix=half.digest[:16],
        table_hash=table_hash(half),
        sent_sum=sent,
        received_sum=received,
        message_bytes=1024 * (rank + 1),
        staging_cap_bytes=1 << 20,
        reason="",
    )
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def _records(plan: Plan, **per_rank: dict[str, object]) -> list[Record]:
    return [_record(plan, r, **per_rank.get(f"r{r}", {})) for r in range(3)]


@settings(max_examples=100, deadline=None)
@given(
    reason=st.text(max_size=600),
    sent=st.integers(0, 2**64 - 1),
    message=st.integers(0, 2**40),
    base=st.integers(-1, 2**62),
    layout=st.binary(min_size=8, max_size=8),
)
def test_a_record_survives_encoding_with_its_reason_cut_at_a_character(
    reason: str, sent: int, message: int, base: int, layout: bytes
) -> None:
    r = dataclasses.replace(
        _record(_plan(), 1),
        reason=reason,
        sent_sum=sent,
        message_bytes=message,
        refused=True,
        base_version=base,
        base_layout=layout,
    )
    data = encode(r)
    assert len(data) == RECORD_BYTES
    back = decode(data)
    assert back.reason == reason.encode("utf-8", "replace")[:384].decode("utf-8", "ignore")
    assert dataclasses.replace(back, reason="") == dataclasses.replace(r, reason="")


def test_a_delta_runs_only_on_one_base_every_rank_names_under_the_layout_agreed_now() -> None:
    layout = b"L" * 8
    same = {"base_version": 4, "base_layout": layout}
    records = _records(_plan(), r0=same, r1=same, r2=same)
    assert delta_base(records, layout) == 4
    assert delta_base(records, b"M" * 8) is None  # the messages are laid out otherwise now
    assert delta_base(_records(_plan(), r0=same, r1=same, r2={**same, "base_version": 3}), layout) is None
    assert (
        delta_base(_records(_plan(), r0=same, r1=same, r2={**same, "base_layout": b"M" * 8}), layout) is None
    )
    assert delta_base(_records(_plan(), r0=same, r1=same), layout) is None  # rank 2 names no base
    none = {"base_version": -1, "base_layout": layout}
    assert delta_base(_records(_plan(), r0=none, r1=none, r2=none), layout) is None


def test_ranks_that_agree_get_every_rank_s_message_size() -> None:
    assert decide(_records(_plan())) == [1024, 2048, 3072]


def test_a_refusal_names_every_refusing_rank_and_its_reason() -> None:
    plan = _plan()
    records = _records(
        plan, r1={"refused": True, "reason": "no target storage"}, r2={"refused": True, "reason": "bad"}
    )
    with pytest.raises(PlanMismatchError, match=r"rank 1: no target storage; rank 2: bad"):
        decide(records)


def test_a_rank_with_another_plan_is_named_against_the_majority() -> None:
    plan = _plan()
    records = _records(plan, r2={"digest_sha": digest_sha("other"), "digest_prefix": "other"})
    with pytest.raises(
        PlanMismatchError, match=r"ranks 0, 1 hold plan digest .*, rank 2 holds plan digest other"
    ):
        decide(records)


def test_the_same_digest_with_another_tensor_table_is_refused() -> None:
    records = _records(_plan(), r0={"table_hash": b"x" * 16})
    with pytest.raises(
        PlanMismatchError, match=r"rank 0 holds a tensor table that differs from that of ranks 1, 2"
    ):
        decide(records)


def test_ranks_with_different_executor_options_are_refused() -> None:
    records = _records(_plan(), r1={"zero_copy": False})
    with pytest.raises(PlanMismatchError, match="zero_copy=False"):
        decide(records)


def test_halves_that_lose_a_segment_are_refused_even_under_one_digest() -> None:
    plan = _plan()
    records = _records(plan)
    records[2] = dataclasses.replace(records[2], received_sum=0)
    with pytest.raises(PlanMismatchError, match="do not fit together"):
        decide(records)


def test_a_record_of_another_format_is_refused_by_name() -> None:
    records = _records(_plan(), r1={"magic": b"RSX9"})
    with pytest.raises(PlanMismatchError, match=r"rank 1 speaks transport format"):
        decide(records)


def test_every_rank_decides_the_same_error_from_the_same_records() -> None:
    records = _records(_plan(), r0={"refused": True, "reason": "x"}, r2={"digest_sha": digest_sha("y")})
    messages = set()
    for _ in range(3):
        with pytest.raises(PlanMismatchError) as e:
            decide([decode(encode(r)) for r in records])
        messages.add(str(e.value))
    assert len(messages) == 1
