"""The buffer pool loaded forms are written into: buffers reused by size, never while something else views
them, at most one kept per size."""

from __future__ import annotations

import pytest
import torch

from rollout_sync.rollout.buffer_pool import BufferPool


def test_a_buffer_given_back_is_handed_out_again_for_the_same_size_only():
    pool = BufferPool()
    a = pool.take(64, "cpu")
    view = a.view(torch.float32)
    view.fill_(1.0)
    del view
    assert pool.give_back(a)
    assert pool.take(64, "cpu") is a and pool.allocations == 1
    b = pool.take(128, "cpu")
    assert b is not a and pool.allocations == 2
    assert pool.held_bytes == 192


def test_a_buffer_still_viewed_elsewhere_is_not_taken_back_until_the_view_is_gone():
    pool = BufferPool()
    a = pool.take(64, "cpu")
    kernel_form = a.view(torch.float32)[:8]  # e.g. a kernel's form made as a view of the loaded form
    assert not pool.give_back(a)
    assert pool.take(64, "cpu") is not a  # never handed out while viewed
    del kernel_form
    assert pool.give_back(a)


def test_a_forgotten_buffer_stays_with_its_viewer_and_is_no_longer_counted():
    pool = BufferPool()
    a = pool.take(64, "cpu")
    kept = a[:16]
    assert not pool.give_back(a)
    pool.forget(a)
    assert pool.held_bytes == 0
    assert kept.numel() == 16


def test_at_most_one_buffer_per_size_is_kept_and_missing_bytes_counts_what_take_allocates():
    pool = BufferPool()
    a, b = pool.take(64, "cpu"), pool.take(64, "cpu")
    assert pool.give_back(a) and pool.give_back(b)
    assert pool.held_bytes == 64
    assert pool.missing_bytes([(64, "cpu"), (64, "cpu"), (32, "cpu")]) == 64 + 32
    with pytest.raises(ValueError, match="not handed out by this pool"):
        pool.give_back(torch.empty(64, dtype=torch.uint8))
