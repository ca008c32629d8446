"""Wire format: maps, plans and halves round-trip; other versions, kinds and malformed bodies are refused."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_layouts import ANY, flat_runs, rows, shapes, tensor_maps

from rollout_sync.errors import HoleError, WireFormatError
from rollout_sync.planning import wire
from rollout_sync.planning.planner import plan_model


@st.composite
def model(draw):
    sources, targets = [], []
    for k in range(draw(st.integers(1, 3))):
        shape = draw(shapes(1, 4, max_numel=150))
        sources.append(draw(tensor_maps(shape, 0, ANY, name=f"layers.{k}.w", dtype="bfloat16")))
        targets.append(draw(tensor_maps(shape, 30, ANY, name=f"layers.{k}.w", dtype="float32")))
    return sources, targets


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model(), st.booleans())
def test_maps_plans_and_halves_round_trip(m, compress):
    sources, targets = m
    assert wire.decode_maps(wire.encode_maps(sources, compress=compress)) == tuple(sources)
    plan = plan_model(sources, targets, "balanced")
    back = wire.decode_plan(wire.encode_plan(plan, compress=compress))
    assert back == plan
    assert back.digest == plan.digest
    assert back.segments == plan.segments
    for rank in {*range(0, 40)}:
        half = plan.half(rank)
        assert wire.decode_half(wire.encode_half(half, compress=compress)) == half


def test_the_digest_is_the_sha256_of_the_uncompressed_bytes():
    import hashlib

    sources, targets = _small()
    plan = plan_model(sources, targets)
    assert plan.digest == hashlib.sha256(wire.encode_plan(plan, compress=False)).hexdigest()
    assert wire.encode_plan(plan) != wire.encode_plan(plan, compress=False)


def _small():
    return [rows("w", (8, 4), [0, 1])], [flat_runs("w", (8, 4), [0, 5, 19, 32], [2, 3, 4])]


def _reheader(data: bytes, *, magic=None, kind=None, version=None, flags=None) -> bytes:
    m, k, v, f = struct.unpack_from(">5scHB", data)
    head = struct.pack(
        ">5scHB", magic or m, kind or k, v if version is None else version, f if flags is None else flags
    )
    return head + data[9:]


@pytest.mark.parametrize("encode", ["maps", "plan", "half"])
def test_a_message_of_another_version_is_refused(encode):
    sources, targets = _small()
    plan = plan_model(sources, targets)
    data = {
        "maps": lambda: wire.encode_maps(sources),
        "plan": lambda: wire.encode_plan(plan),
        "half": lambda: wire.encode_half(plan.half(2)),
    }[encode]()
    decode = {"maps": wire.decode_maps, "plan": wire.decode_plan, "half": wire.decode_half}[encode]
    with pytest.raises(WireFormatError, match="version 2"):
        decode(_reheader(data, version=wire.WIRE_VERSION + 1))


def test_other_magic_kind_flags_and_truncation_are_refused():
    sources, targets = _small()
    data = wire.encode_plan(plan_model(sources, targets), compress=False)
    with pytest.raises(WireFormatError, match="magic"):
        wire.decode_plan(_reheader(data, magic=b"PICKL"))
    with pytest.raises(WireFormatError, match="kind"):
        wire.decode_maps(data)
    with pytest.raises(WireFormatError, match="flags"):
        wire.decode_plan(_reheader(data, flags=4))
    with pytest.raises(WireFormatError):
        wire.decode_plan(data[:5])
    with pytest.raises(WireFormatError):
        wire.decode_plan(data[:-3])
    with pytest.raises(WireFormatError):
        wire.decode_plan(data + b"\0" * 8)
    with pytest.raises(WireFormatError):
        wire.decode_plan(_reheader(data[:40], flags=1))
    with pytest.raises(WireFormatError):
        wire.decode_maps(b"RSYNCM\x00\x01\x00not json")
    with pytest.raises(WireFormatError):
        wire.decode_maps(
            b"RSYNCM\x00\x01\x00"
            + b'{"maps": [["w", [4], "float32", [[0, [4], [[[0], [4], 0, [1], ["x"]]]]]]]}'
        )


def test_a_plan_whose_records_leave_their_storage_is_refused():
    from rollout_sync.errors import OutOfBoundsError

    sources, targets = _small()
    raw = wire.encode_plan(plan_model(sources, targets), compress=False)
    # the last int64 is the extent of the last segment's last axis: make it reach past the storage
    bad = raw[:-8] + struct.pack("<q", 1000)
    with pytest.raises(OutOfBoundsError):
        wire.decode_plan(bad)


def test_a_decoded_map_is_validated_like_any_other():
    body = b'{"maps":[["w",[4],"float32",[[0,[5],[[[0],[4],0,[1],[0]]]]]]]}'
    with pytest.raises(HoleError):
        wire.decode_maps(b"RSYNCM\x00\x01\x01" + zlib.compress(body))


def test_a_half_whose_segment_leaves_its_storage_is_refused():
    from rollout_sync.errors import OutOfBoundsError

    sources, targets = _small()
    raw = wire.encode_half(plan_model(sources, targets).half(2), compress=False)
    with pytest.raises(OutOfBoundsError):
        wire.decode_half(raw[:-8] + struct.pack("<q", 1000))
