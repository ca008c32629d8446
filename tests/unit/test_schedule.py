"""The transfer schedule, in one process: both ends of a pair derive the same messages, parts tile every
segment exactly once, messages respect the size, copies address exactly the segment's elements, and the
number of rounds follows bytes, not segments or elements."""

from __future__ import annotations

from math import ceil, prod

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.layout.box import row_major_strides
from rollout_sync.layout.dtypes import itemsize
from rollout_sync.planning.half import PlanHalf
from rollout_sync.planning.plan import Plan
from rollout_sync.planning.records import PlannedTensor, Segment
from rollout_sync.transport.core.copies import part_copies
from rollout_sync.transport.core.half_check import check_half
from rollout_sync.transport.core.pair_messages import (
    ALIGN,
    DIRECT_MIN_BYTES,
    Message,
    direct_chunk_bytes,
    is_dense,
    pair_messages,
    wire_dtype,
)
from rollout_sync.transport.core.schedule import build_schedule, peers_of, wanted_message_bytes

DTYPES = ("float32", "bfloat16", "float16", "float64", "int8")


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """Random plans: 1-3 tensors of 1-3 axes over 2-4 ranks; each segment a random box of the logical shape,
    read from a row-major or transposed storage and written to another (segments may overlap: the schedule
    does not care, the planner's tests check tiling)."""
    world = draw(st.integers(2, 4))
    tensors = []
    segments = []
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
        sdt, tdt = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
        ranks = list(range(world))
        transposed = draw(st.booleans()) and ndim >= 2
        storage_shape = tuple(reversed(shape)) if transposed else shape
        rm = row_major_strides(storage_shape)
        src_strides = tuple(reversed(rm)) if transposed else rm
        tgt_strides = row_major_strides(shape)
        tensors.append(
            PlannedTensor(
                f"t{i}", shape, sdt, tdt, {r: storage_shape for r in ranks}, {r: shape for r in ranks}
            )
        )
        for _ in range(draw(st.integers(1, 6))):
            origin = tuple(draw(st.integers(0, n - 1)) for n in shape)
            extent = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, origin, strict=True))
            src, tgt = draw(st.sampled_from(ranks)), draw(st.sampled_from(ranks))
            s_off = sum(o * s for o, s in zip(origin, src_strides, strict=True))
            t_off = sum(o * s for o, s in zip(origin, tgt_strides, strict=True))
            segments.append(Segment(i, src, s_off, src_strides, tgt, t_off, tgt_strides, extent))
    return Plan(tensors, list(dict.fromkeys(segments)))  # distinct segments


def _sizes(half: PlanHalf, size: int) -> dict[int, int]:
    send_peers, recv_peers = peers_of(half)
    return {p: size for p in {*send_peers, *recv_peers}}


def _signature(m: Message) -> tuple[object, ...]:
    return (
        m.round,
        m.direct,
        m.nbytes,
        m.tag,
        tuple((p.segment, p.start, p.count, p.byte_offset) for p in m.parts),
    )


@settings(max_examples=150, deadline=None)
@given(plan=plans(), size=st.sampled_from([64, 96, 256, 4096]), zero_copy=st.booleans())
def test_both_ends_of_every_pair_derive_the_same_messages(plan: Plan, size: int, zero_copy: bool) -> None:
    _, targets = plan.ranks()
    sources, _ = plan.ranks()
    schedules = {
        r: build_schedule(plan.half(r), _sizes(plan.half(r), size), zero_copy=zero_copy)
        for r in {*sources, *targets}
    }
    for r, sched in schedules.items():
        for peer in {m.peer for m in sched.sends}:
            mine = [_signature(m) for m in sched.sends if m.peer == peer]
            theirs = [_signature(m) for m in schedules[peer].receives if m.peer == r]
            assert mine == theirs


@settings(max_examples=150, deadline=None)
@given(
    plan=plans(),
    size=st.sampled_from([64, 96, 256, 4096]),
    zero_copy=st.booleans(),
    depth=st.sampled_from([1, 2]),
)
def test_parts_tile_every_segment_once_and_messages_keep_their_size(
    plan: Plan, size: int, zero_copy: bool, depth: int
) -> None:
    for rank in range(8):
        half = plan.half(rank)
        sched = build_schedule(half, _sizes(half, size), zero_copy=zero_copy, depth=depth)
        covered: dict[Segment, list[tuple[int, int]]] = {}
        for m in (*sched.sends, *sched.receives):
            assert m.nbytes <= size
            end = 0
            for p in m.parts:
                t = half.tensors[p.segment.tensor]
                wire = itemsize(wire_dtype(t.source_dtype, t.target_dtype))
                assert p.byte_offset % wire == 0 and p.byte_offset >= end
                end = p.byte_offset + p.count * wire
                covered.setdefault(p.segment, []).append((p.start, p.count))
            assert end == m.nbytes
            if m.direct:
                (p,) = m.parts
                t = half.tensors[p.segment.tensor]
                assert t.source_dtype == t.target_dtype
                assert is_dense(p.segment.extent, p.segment.source_strides)
                assert is_dense(p.segment.extent, p.segment.target_strides)
        for s in (*half.sends, *half.receives):
            runs = sorted(covered.get(s, []))
            assert runs, s
            position = 0
            for start, count in runs:
                assert start == position and count > 0
                position += count
            assert position == s.numel
        # staging slots hold every packed message and fit in depth x peers x size
        for direction, msgs in (("send", sched.sends), ("recv", sched.receives)):
            for m in msgs:
                if not m.direct:
                    offset, nbytes = sched.slot(direction, m)
                    assert offset % ALIGN == 0 and m.nbytes <= nbytes
        send_peers, recv_peers = peers_of(half)
        assert sched.staging_bytes <= depth * (len(send_peers) + len(recv_peers)) * size


def _addresses(extent: tuple[int, ...], strides: tuple[int, ...], offset: int) -> list[int]:
    """Storage element of every element of a view, in row-major order of ``extent``."""
    out = []
    for flat in range(prod(extent)):
        at, rest = offset, flat
        for e, s in zip(reversed(extent), reversed(strides), strict=True):
            at += rest % e * s
            rest //= e
        out.append(at)
    return out


@settings(max_examples=200, deadline=None)
@given(plan=plans(), size=st.sampled_from([64, 160, 1024]))
def test_the_copies_of_a_part_address_exactly_its_run_of_the_segment_in_order(plan: Plan, size: int) -> None:
    for rank in range(4):
        half = plan.half(rank)
        sched = build_schedule(half, _sizes(half, size), zero_copy=False)
        for m in (*sched.sends, *sched.receives):
            for p in m.parts:
                s = p.segment
                for side, offset, strides in (
                    ("source", s.source_offset, s.source_strides),
                    ("target", s.target_offset, s.target_strides),
                ):
                    want = _addresses(s.extent, strides, offset)[p.start : p.start + p.count]
                    got = [0] * p.count
                    copies = part_copies(p, side)
                    assert len(copies) <= max(1, 2 * len(s.extent) - 1)
                    for c in copies:
                        for k, at in enumerate(_addresses(c.extent, c.strides, c.offset)):
                            got[c.buffer_offset + k] = at
                    assert got == want


def _flat_half(numel: int, dtype: str, target_strides: tuple[int, ...] = (1,)) -> PlanHalf:
    t = PlannedTensor("flat", (numel,), dtype, dtype, {0: (numel,)}, {1: (numel,)})
    return Plan([t], [Segment(0, 0, 0, (1,), 1, 0, target_strides, (numel,))]).half(0)


def test_a_flat_run_of_a_million_elements_takes_rounds_by_bytes_not_by_elements() -> None:
    half = _flat_half(1_000_000, "float32")
    message = 64 << 10
    packed = pair_messages(half, half.sends, 1, message, zero_copy=False)
    assert len(packed) == ceil(4_000_000 / message)
    assert sum(p.count for m in packed for p in m.parts) == 1_000_000
    direct = pair_messages(half, half.sends, 1, message, zero_copy=True)
    assert all(m.direct for m in direct) and len(direct) == ceil(4_000_000 / direct_chunk_bytes(message))
    huge = _flat_half(40_000_000, "float32")
    assert len(pair_messages(huge, huge.sends, 1, message, zero_copy=True)) == ceil(160e6 / (64 << 20))


def test_many_small_segments_share_one_message_per_round() -> None:
    t = PlannedTensor("w", (1000, 8), "bfloat16", "bfloat16", {0: (1000, 8)}, {1: (8, 1000)})
    # 1000 rows, each its own segment, written transposed: not dense on the target, so packed.
    segments = [Segment(0, 0, r * 8, (8, 1), 1, r, (1000, 1), (1, 8)) for r in range(1000)]
    half = Plan([t], segments).half(0)
    msgs = pair_messages(half, half.sends, 1, 4096, zero_copy=True)
    assert len(msgs) == ceil(1000 * 8 * 2 / 4096)
    assert sum(len(m.parts) for m in msgs) < 1000 + len(msgs)


def test_a_dense_segment_goes_direct_only_above_the_threshold_and_with_equal_dtypes() -> None:
    small = _flat_half(DIRECT_MIN_BYTES // 4 - 1, "float32")
    big = _flat_half(DIRECT_MIN_BYTES // 4, "float32")
    assert not pair_messages(small, small.sends, 1, 1 << 20, zero_copy=True)[0].direct
    assert pair_messages(big, big.sends, 1, 1 << 20, zero_copy=True)[0].direct
    t = PlannedTensor("c", (1 << 20,), "float32", "bfloat16", {0: (1 << 20,)}, {1: (1 << 20,)})
    cast = Plan([t], [Segment(0, 0, 0, (1,), 1, 0, (1,), (1 << 20,))]).half(0)
    assert not any(m.direct for m in pair_messages(cast, cast.sends, 1, 1 << 20, zero_copy=True))


def test_the_message_size_offer_divides_the_cap_over_every_staging_slot() -> None:
    t = PlannedTensor("w", (8,), "float32", "float32", {0: (8,), 1: (8,)}, {1: (8,), 2: (8,), 3: (8,)})
    segments = [Segment(0, 0, 0, (1,), 2, 0, (1,), (8,)), Segment(0, 0, 0, (1,), 3, 0, (1,), (8,))]
    segments += [Segment(0, 1, 0, (1,), 1, 0, (1,), (8,))]
    half = Plan([t], segments).half(0)
    assert peers_of(half) == ((2, 3), ())
    assert wanted_message_bytes(half, 1 << 20, depth=2) == (1 << 20) // 4
    assert wanted_message_bytes(half, 1000, depth=1) == 496


def test_is_dense_ignores_axes_of_extent_one() -> None:
    assert is_dense((1, 5), (999, 1))
    assert is_dense((3, 4), (4, 1))
    assert not is_dense((3, 4), (5, 1))
    assert not is_dense((4, 3), (1, 4))


def _raw_half(segment: Segment, storage: tuple[int, ...] = (10,), rank: int = 0) -> PlanHalf:
    t = PlannedTensor("w", (10,), "float32", "float32", {0: storage}, {1: (10,)})
    return PlanHalf(rank, "d", (t,), (segment,), (), ())


def test_a_half_whose_segment_leaves_its_storage_is_refused_with_the_tensor_and_rank() -> None:
    reason = check_half(_raw_half(Segment(0, 0, 5, (1,), 1, 0, (1,), (6,)), storage=(10,)))
    assert reason is not None and "'w'" in reason and "rank 0" in reason and "(10,)" in reason
    assert check_half(_raw_half(Segment(0, 0, 4, (1,), 1, 0, (1,), (6,)))) is None


def test_a_half_listing_a_segment_of_another_rank_is_refused() -> None:
    reason = check_half(_raw_half(Segment(0, 0, 0, (1,), 1, 0, (1,), (6,)), rank=1))
    assert reason is not None and "does not belong" in reason


def test_wire_dtype_is_the_narrower_floating_dtype():
    assert wire_dtype("float32", "bfloat16") == "bfloat16"  # the sender casts: half the bytes
    assert wire_dtype("float64", "float32") == "float32"
    assert wire_dtype("bfloat16", "float32") == "bfloat16"  # widening: the receiver casts
    assert wire_dtype("float16", "bfloat16") == "float16"  # same size: the source's
    assert wire_dtype("float32", "int8") == "float32"  # not both floating: the receiver casts
    assert wire_dtype("bfloat16", "bfloat16") == "bfloat16"
