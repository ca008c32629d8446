"""The trainer hook's buffer watch: replaced buffers are stale, buffers moved in place are not."""

from __future__ import annotations

import torch

from rollout_sync.trainer.freshness import BufferWatch, anchor_builder


def watch_of(holder: dict[str, torch.Tensor]) -> BufferWatch:
    add, done = anchor_builder()
    for name in holder:
        add(name, f"param {name}", holder[name], lambda name=name: holder[name])
    return done()


def test_an_untouched_buffer_is_fresh_and_a_replaced_one_is_named():
    holder = {"a": torch.zeros(8), "b": torch.ones(4, dtype=torch.bfloat16)}
    watch = watch_of(holder)
    assert watch.stale() == []

    holder["b"] = holder["b"].clone()  # what Optimizer.load_state_dict does to an Adam state
    stale = watch.stale()
    assert [s.names for s in stale] == [("b",)]
    assert "param b" in stale[0].describe() and "bfloat16" in stale[0].describe()


def test_a_buffer_moved_into_shared_memory_in_place_is_still_fresh():
    """The mapped same-host transport moves a trainer storage into shared memory in place: its address
    changes, the storage every view holds does not. The watch must not call that a replacement."""
    flat = torch.arange(16, dtype=torch.float32)
    holder = {"w": flat[4:12]}
    watch = watch_of(holder)
    address = flat.untyped_storage().data_ptr()
    flat.untyped_storage()._share_fd_cpu_()
    assert flat.untyped_storage().data_ptr() != address  # really moved
    assert watch.stale() == []


def test_a_view_cut_at_another_offset_or_a_gone_buffer_is_stale():
    flat = torch.arange(16, dtype=torch.float32)
    holder = {"w": flat[4:12]}
    watch = watch_of(holder)
    holder["w"] = flat[0:8]  # same storage, other elements
    assert [s.names for s in watch.stale()] == [("w",)]
    del holder["w"]
    (gone,) = watch.stale()
    assert gone.now is None and "no tensor" in gone.describe()
