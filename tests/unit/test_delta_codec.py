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

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.planning.planner import plan_model
from rollout_sync.transport.delta import message_itemsize
from rollout_sync.transport.delta_codec import (
    bits_dtype,
    changed_positions,
    decode_positions,
    decode_values,
    encode,
    encoded_bytes,
    max_encoded_bytes,
)
from rollout_sync.transport.delta_landing import Landing
from rollout_sync.transport.messages import pair_messages
from rollout_sync.transport.program import compile_program, unpack
from rollout_sync.transport.schedule import build_schedule
from rollout_sync.transport.targets import Targets

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


def test_a_message_far_past_the_limit_is_counted_from_a_sample() -> None:
    g = torch.Generator().manual_seed(5)
    n = 1 << 20
    old = torch.randint(-1000, 1000, (n,), generator=g).to(torch.int16)
    new = old.clone()
    at = torch.randperm(n, generator=g)[: n // 2]
    new[at] += 1
    count, positions = changed_positions(new, old, n // 8)
    assert positions is None
    assert abs(count - n // 2) < 0.02 * n  # every 16th word sampled: 65,536 words, 262,144 elements
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
