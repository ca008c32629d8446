"""The delta coding of a message's changes, and where a message's elements land: against direct oracles.

- ``encode`` → ``decode_positions`` / ``decode_values`` gives back exactly the changed positions and new bit
  patterns, for every element size, with gaps and differences that need escapes, -0.0 and NaN payloads;
- its size is what the module docstring says (about 2.3 bytes per changed bf16 element at 1% moved by few
  ulps);
- ``Landing.locate`` finds, for every element of a message, the storage offset the message's unpack writes
  (checked by unpacking a message whose elements are their own positions, as bit patterns);
- ``pair_messages(uniform=True)`` never mixes element sizes in a packed message.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.planning.planner import plan_model
from rollout_sync.transport.core.pair_messages import pair_messages
from rollout_sync.transport.core.program import compile_program, pack, torch_dtype, unpack
from rollout_sync.transport.core.schedule import build_schedule
from rollout_sync.transport.core.target_streams import Targets
from rollout_sync.transport.delta import compare as delta_compare
from rollout_sync.transport.delta import landing as delta_landing
from rollout_sync.transport.delta.change_codec import (
    HEAD_BYTES,
    _decode_positions_torch,
    _decode_values_torch,
    _encode_torch,
    bits_dtype,
    changed_positions,
    decode_positions,
    decode_values,
    encode,
    encoded_bytes,
    max_encoded_bytes,
)
from rollout_sync.transport.delta.compare import Run, Scratch, find_changes, np_bits
from rollout_sync.transport.delta.landing import Landing, apply_changes
from rollout_sync.transport.delta.packed_program import message_itemsize
from rollout_sync.transport.delta.shadow import message_runs

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int32)


def _round_trip(new: torch.Tensor, old: torch.Tensor) -> tuple[int, int]:
    bits = bits_dtype(new.element_size())
    nb, ob = new.view(bits), old.view(bits)
    count, positions = changed_positions(nb, ob, nb.numel())
    assert positions is not None and positions.numel() == count
    assert torch.equal(positions, (nb != ob).nonzero().squeeze(1))
    out = torch.empty(max_encoded_bytes(count, new.element_size()), dtype=torch.uint8)
    nbytes = encode(nb, ob, positions, out)
    assert nbytes == encoded_bytes(out) <= out.numel()
    back = decode_positions(out)
    assert torch.equal(back, positions)
    rebuilt = ob.clone()
    rebuilt[back] = decode_values(out, ob[back])
    assert torch.equal(rebuilt, nb)
    return count, nbytes


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 3000),
    seed=st.integers(0, 2**31 - 1),
    share=st.floats(0.0, 1.0),
    jump=st.floats(0.0, 1.0),
)
def test_the_changes_come_back_exactly_for_every_element_size(
    dtype: torch.dtype, n: int, seed: int, share: float, jump: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        old = (torch.randn(n, generator=g) * 10).to(dtype)
    else:
        old = torch.randint(0, 100, (n,), generator=g).to(dtype)
    new = old.clone()
    chosen = torch.rand(n, generator=g) < share
    k = int(chosen.sum())
    bits = bits_dtype(new.element_size())
    step = torch.randint(-3, 4, (k,), generator=g).to(torch.int64)
    far = torch.rand(k, generator=g) < jump
    step = torch.where(far, torch.randint(-(2**6), 2**6, (k,), generator=g) * 1000 + 200, step)
    moved = new.view(bits)[chosen].to(torch.int64) + step
    span = 1 << (8 * new.element_size() - 1)
    if new.element_size() < 8:
        moved = torch.remainder(moved + span, 2 * span) - span
    if bits == torch.uint8:
        moved = torch.remainder(moved, 256)
    new.view(bits)[chosen] = moved.to(bits)
    _round_trip(new, old)


def test_signed_zeros_nans_and_gaps_past_every_escape_are_exact() -> None:
    old = torch.zeros(200_000, dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0  # bit pattern 0x8000: far from 0x0000
    new[1] = float("nan")
    new[70_000] = 1.0  # a gap of about 70,000 elements
    new[199_999] = -float("inf")
    count, _ = _round_trip(new, old)
    assert count == 4


def test_a_changed_bf16_element_moved_by_few_ulps_costs_about_two_bytes_and_a_third() -> None:
    g = torch.Generator().manual_seed(3)
    n = 1_000_000
    old = torch.randn(n, generator=g).to(torch.bfloat16)
    new = old.clone()
    at = torch.randperm(n, generator=g)[: n // 100]
    new.view(torch.int16)[at] += torch.randint(1, 5, (at.numel(),), generator=g).to(torch.int16)
    count, nbytes = _round_trip(new, old)
    assert count == n // 100
    assert 2.2 < nbytes / count < 2.45
    assert nbytes <= 1.5 * 0.01 * 2 * n  # well within 1.5 x 1% of the whole message


def test_more_changes_than_the_limit_return_no_positions() -> None:
    old = torch.zeros(100, dtype=torch.int16)
    new = old.clone()
    new[:20] = 1
    assert changed_positions(new, old, 19) == (20, None)
    count, positions = changed_positions(new, old, 20)
    assert count == 20 and positions is not None and positions.tolist() == list(range(20))


def _maps() -> tuple[list[TensorMap], list[TensorMap]]:
    """Rank 0 holds every tensor whole; rank 1 holds one transposed, one as swapped column blocks, one in fp32."""
    sources, targets = [], []
    shapes = {"a": (6, 10), "b": (7, 5), "c": (33,), "d": (4, 4)}
    dtypes = {"a": "bfloat16", "b": "bfloat16", "c": "bfloat16", "d": "float32"}
    for name, shape in shapes.items():
        whole = Box((0,) * len(shape), shape)
        sources.append(
            TensorMap(
                name,
                shape,
                dtypes[name],
                {0: RankStorage(shape, (Piece(whole, 0, row_major_strides(shape), (0,)),))},
            )
        )
        if name == "a":  # stored transposed
            storage = RankStorage((10, 6), (Piece(whole, 0, (1, 6), (1,)),))
        elif name == "b":  # two column blocks, stored in swapped order
            storage = RankStorage(
                (7, 5),
                (
                    Piece(Box((0, 2), (7, 3)), 0, (5, 1), (1,)),
                    Piece(Box((0, 0), (7, 2)), 3, (5, 1), (1,)),
                ),
            )
        else:
            storage = RankStorage(shape, (Piece(whole, 0, row_major_strides(shape), (1,)),))
        targets.append(TensorMap(name, shape, dtypes[name], {1: storage}))
    return sources, targets


def test_uniform_messages_hold_one_element_size() -> None:
    sources, targets = _maps()
    half = plan_model(sources, targets).half(1)
    for size in (64, 128, 4096):
        mixed = pair_messages(half, half.receives, 0, size, zero_copy=False)
        uniform = pair_messages(half, half.receives, 0, size, zero_copy=False, uniform=True)
        for m in uniform:
            assert len({half.tensors[p.segment.tensor].target_dtype for p in m.parts}) == 1
        assert sum(p.count for m in uniform for p in m.parts) == sum(p.count for m in mixed for p in m.parts)
    assert any(len({half.tensors[p.segment.tensor].target_dtype for p in m.parts}) > 1 for m in mixed)


def test_locate_finds_every_element_of_a_message_where_unpack_writes_it() -> None:
    sources, targets = _maps()
    half = plan_model(sources, targets).half(1)
    for size in (64, 96, 4096):
        _check_locate(half, targets, size)


def _check_locate(half, targets, size: int) -> None:
    schedule = build_schedule(half, {0: size}, zero_copy=False, depth=1, uniform=True)
    program = compile_program(half, schedule)
    storages = {m.name: torch.zeros(m.ranks[1].shape, dtype=getattr(torch, m.dtype)) for m in targets}
    wrapped = Targets(storages, None, half, program)
    for entries in program.receives.values():
        for m, parts in entries:
            itemsize = message_itemsize(parts)
            assert itemsize is not None
            buf = torch.zeros(m.nbytes, dtype=torch.uint8)
            bits = buf.view(bits_dtype(itemsize))
            bits.copy_(torch.arange(1, bits.numel() + 1).to(bits.dtype))
            unpack(buf, parts, wrapped)
            landing = Landing.of(parts, itemsize)
            names, offsets = landing.locate(torch.arange(bits.numel()))
            for position, (i, offset) in enumerate(zip(names.tolist(), offsets.tolist(), strict=True)):
                name = landing.names[i]
                got = storages[name].view(-1).view(bits_dtype(itemsize))[offset]
                assert int(got) == position + 1


def test_a_message_past_the_limit_is_counted_from_what_was_compared() -> None:
    g = torch.Generator().manual_seed(5)
    n = 1 << 20
    old = torch.randint(-1000, 1000, (n,), generator=g).to(torch.int16)
    new = old.clone()
    at = torch.randperm(n, generator=g)[: n // 2]
    new[at] += 1
    count, positions = changed_positions(new, old, n // 8)
    assert positions is None
    assert abs(count - n // 2) < 0.02 * n  # the first chunk (131,072 words, 524,288 elements), scaled
    # just past the limit: compared in full, counted exactly
    new = old.clone()
    new[torch.randperm(n, generator=g)[: n // 8 + 1]] += 1
    assert changed_positions(new, old, n // 8) == (n // 8 + 1, None)


def test_a_payload_that_does_not_decode_is_refused() -> None:
    old = torch.zeros(1000, dtype=torch.int16)
    new = old.clone()
    new[[3, 600]] = 5
    count, positions = changed_positions(new, old, 1000)
    assert positions is not None
    out = torch.empty(max_encoded_bytes(count, 2), dtype=torch.uint8)
    encode(new, old, positions, out)
    # the long gap (596) is escaped; an escape below 255 would let positions run backwards
    escape_at = 36  # after the 32-byte head and the two gap bytes, at a multiple of 4
    out[escape_at : escape_at + 4].view(torch.int32).fill_(-5)
    with pytest.raises(ValueError, match="gap escapes"):
        decode_positions(out)


# -- the CPU (NumPy) paths against the torch ones and against direct oracles ---------------------------------


def _bits_pair(n: int, itemsize: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    bits = np_bits(itemsize)
    old = g.integers(0, 1 << 30, n * itemsize, dtype=np.int64).astype(np.uint8).view(bits)
    new = old.copy()
    at = np.flatnonzero(g.random(n) < share)
    moved = new[at].astype(np.int64) + g.integers(-300, 300, at.size)
    new[at] = moved.astype(bits)  # wraps; a step of 0 leaves an element as it was
    return new, old


@settings(max_examples=60, deadline=None)
@given(
    itemsize=st.sampled_from((1, 2, 4, 8)),
    n=st.integers(0, 5000),
    new_skip=st.integers(0, 7),
    old_skip=st.integers(0, 7),
    share=st.floats(0.0, 0.3),
    seed=st.integers(0, 2**31 - 1),
)
def test_find_changes_matches_an_element_by_element_comparison_at_any_alignment(
    itemsize: int, n: int, new_skip: int, old_skip: int, share: float, seed: int
) -> None:
    new_all, old_all = _bits_pair(n + 8, itemsize, share, seed)
    new, old = new_all[new_skip : new_skip + n], old_all[old_skip : old_skip + n]
    expected = np.flatnonzero(new != old)
    count, changes = find_changes([Run(new, old, 5)], itemsize, n, Scratch())
    assert changes is not None and count == expected.size == changes.count
    assert np.array_equal(changes.positions, expected + 5)
    assert np.array_equal(changes.new, new[expected]) and np.array_equal(changes.old, old[expected])


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("cols", [3, 8, 40])
def test_find_changes_reads_strided_rows_and_chunks_like_the_packed_message(
    itemsize: int, cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delta_compare, "CHUNK_WORDS", 8)  # many chunks, rows split across none
    rows = 50
    source, _ = _bits_pair(rows * 2 * cols, itemsize, 0.0, 1)
    strided = source.reshape(rows, 2 * cols)[:, cols:]  # every other half-row: rows of a strided view
    new_packed, old = _bits_pair(rows * cols, itemsize, 0.2, 2)
    strided[:] = new_packed.reshape(rows, cols)
    head, _ = _bits_pair(7, itemsize, 0.0, 3)
    old_head = head.copy()
    old_head[[0, 6]] ^= 1
    runs = [Run(strided, old.reshape(rows, cols), 7), Run(head, old_head, 0)]
    whole_new, whole_old = np.concatenate([head, new_packed]), np.concatenate([old_head, old])
    count, changes = find_changes(runs[::-1], itemsize, rows * cols, Scratch(), update=True)
    expected = np.flatnonzero(whole_new != whole_old)
    assert changes is not None and count == expected.size
    assert np.array_equal(changes.positions, expected)
    assert np.array_equal(changes.new, whole_new[expected])
    assert np.array_equal(changes.old, whole_old[expected])
    assert np.array_equal(old, new_packed) and np.array_equal(old_head, head)  # updated in place


def test_past_the_limit_the_count_is_the_compared_part_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_compare, "CHUNK_WORDS", 1024)
    new = np.zeros(40_960, dtype=np.int16)
    old = new.copy()
    new[: 4096 * 2] = 1  # the first two chunks' every element
    assert find_changes([Run(new, old, 0)], 2, 4095, Scratch()) == (40_960, None)
    assert find_changes([Run(new, old, 0)], 2, 4096 * 2, Scratch())[0] == 4096 * 2


def test_scratch_buffers_grow_and_are_reused() -> None:
    scratch = Scratch()
    a = scratch.get("x", 100, np.int64)
    b = scratch.get("x", 50, np.int16)
    assert b.ctypes.data == a.ctypes.data and scratch.nbytes >= 800
    c = scratch.get("x", 10_000, np.int64)
    assert c.size == 10_000 and scratch.nbytes >= 80_000


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_the_numpy_and_torch_codings_write_the_same_bytes_and_read_each_other(itemsize: int) -> None:
    new_np, old_np = _bits_pair(20_000, itemsize, 0.05, itemsize)
    new_np[[0, 19_999]] ^= 1  # first and last elements, and a gap past 255 after a stretch left alone
    new_np[1:2000] = old_np[1:2000]
    bits = bits_dtype(itemsize)
    new, old = torch.from_numpy(new_np).view(bits), torch.from_numpy(old_np).view(bits)
    positions = (new != old).nonzero().squeeze(1)
    size = max_encoded_bytes(positions.numel(), itemsize)
    by_numpy, by_torch = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    nbytes = encode(new, old, positions, by_numpy)
    assert _encode_torch(itemsize, old, positions, by_torch, new[positions]) == nbytes
    assert torch.equal(by_numpy, by_torch)
    assert torch.equal(_decode_positions_torch(by_numpy), positions)
    assert torch.equal(decode_positions(by_numpy), positions)
    assert torch.equal(_decode_values_torch(by_numpy, old[positions]), new[positions])
    assert torch.equal(decode_values(by_numpy, old[positions]), new[positions])


def test_truncated_or_inconsistent_payloads_are_refused() -> None:
    old = torch.zeros(1000, dtype=torch.int16)
    new = old.clone()
    new[[3, 600]] = torch.tensor([5, 30_000], dtype=torch.int16)  # the second value escapes
    positions = torch.tensor([3, 600])
    out = torch.zeros(max_encoded_bytes(2, 2), dtype=torch.uint8)
    nbytes = encode(new, old, positions, out)
    with pytest.raises(ValueError, match="shorter"):
        decode_positions(out[: nbytes - 1])
    with pytest.raises(ValueError, match="no head"):
        decode_positions(out[:8])
    bad = out.clone()
    bad[HEAD_BYTES + 4 + 4 + 1] = 0  # the escaped value's byte no longer says so
    with pytest.raises(ValueError, match="value escapes"):
        decode_values(bad[:nbytes], old[positions])
    with pytest.raises(ValueError, match="value escapes"):
        _decode_values_torch(bad[:nbytes], old[positions])
    bad = out.clone()
    bad[8:16].view(torch.int64).fill_(3)  # more gap escapes than changes
    with pytest.raises(ValueError, match="does not add up"):
        decode_positions(bad)


def _uniform_messages(half, peer: int, kind: str):
    """Every packed message of ``half`` with ``peer`` (``kind``: "sends" or "receives") under uniform
    schedules of three message sizes: its program, the message, its parts and their element size."""
    for size in (64, 96, 4096):
        schedule = build_schedule(half, {peer: size}, zero_copy=False, depth=1, uniform=True)
        program = compile_program(half, schedule)
        for entries in getattr(program, kind).values():
            for m, parts in entries:
                itemsize = message_itemsize(parts)
                assert itemsize is not None
                yield program, m, parts, itemsize


def test_apply_changes_through_numpy_and_torch_leaves_the_same_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(delta_landing, "APPLY_CHUNK", 7)
    sources, targets = _maps()
    half = plan_model(sources, targets).half(1)
    flat = set()
    for program, m, parts, itemsize in _uniform_messages(half, 0, "receives"):
        landing = Landing.of(parts, itemsize)
        flat.add(landing.flat)
        elements = m.nbytes // itemsize
        bits = bits_dtype(itemsize)
        start = torch.zeros(m.nbytes, dtype=torch.uint8)
        start.view(bits).copy_(torch.arange(elements).to(bits))
        changed = start.clone()
        g = torch.Generator().manual_seed(elements)
        at = (torch.rand(elements, generator=g) < 0.3).nonzero().squeeze(1)
        changed.view(bits)[at] += torch.randint(1, 400, (at.numel(),), generator=g).to(bits)
        payload = torch.zeros(max_encoded_bytes(at.numel(), itemsize), dtype=torch.uint8)
        nbytes = encode(changed.view(bits), start.view(bits), at, payload)
        for scratch in (Scratch(), None):  # NumPy, torch
            storages = {t.name: torch.zeros(t.ranks[1].shape, dtype=torch_dtype(t.dtype)) for t in targets}
            storages["c"] = storages["c"].float()  # wider than the wire: read and written by torch
            wrapped = Targets(storages, None, half, program)
            unpack(start, parts, wrapped)
            n = apply_changes(payload[:nbytes], landing, wrapped, elements, scratch)
            assert n == at.numel()
            expected = {k: v.clone() for k, v in storages.items()}
            unpack(changed, parts, Targets(expected, None, half, program))
            assert all(torch.equal(storages[k], expected[k]) for k in storages)
    assert flat == {True, False}  # 1-D copies only, and a transposed target's 2-D ones


def test_message_runs_compare_the_sources_as_the_packed_message() -> None:
    sources, targets = _maps()
    half = plan_model(sources, targets).half(0)
    storages = {m.name: torch.randn(m.ranks[0].shape).to(torch_dtype(m.dtype)) for m in sources}
    storages["c"] = storages["c"].float()  # packed (cast to bf16) before it is compared
    for _, m, parts, itemsize in _uniform_messages(half, 1, "sends"):
        bits = bits_dtype(itemsize)
        shadow = torch.zeros(m.nbytes, dtype=torch.uint8)
        pack(shadow, parts, storages)
        g = torch.Generator().manual_seed(m.nbytes)
        shadow.view(bits)[torch.rand(m.nbytes // itemsize, generator=g) < 0.2] ^= 1
        buf = torch.zeros(m.nbytes, dtype=torch.uint8)
        runs = message_runs(shadow, buf, parts, storages)
        assert runs is not None
        count, changes = find_changes(runs, itemsize, m.nbytes, Scratch())
        packed = torch.zeros(m.nbytes, dtype=torch.uint8)
        pack(packed, parts, storages)
        expected = (packed.view(bits) != shadow.view(bits)).nonzero().squeeze(1)
        assert changes is not None and count == expected.numel()
        assert torch.equal(torch.from_numpy(changes.positions), expected)
        assert torch.equal(torch.from_numpy(changes.new), packed.view(bits)[expected])
