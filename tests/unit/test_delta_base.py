"""A worker's delta base (``rollout_sync.rollout.delta_base``): the next sync applies on what the last one
left only when no other update came in between and every target outlives an update."""

from __future__ import annotations

from rollout_sync.rollout.delta_base import DeltaBase, unchanged_targets


def test_the_first_sync_has_no_base_and_the_next_one_directly_after_it_has() -> None:
    base = DeltaBase()
    assert base.begin(updates=0, persistent=True) is False  # nothing synced yet
    assert base.begin(updates=1, persistent=True) is True  # the update after the last sync's
    assert base.begin(updates=2, persistent=True) is True


def test_another_update_in_between_forgets_the_base_until_the_next_sync() -> None:
    base = DeltaBase()
    base.begin(updates=0, persistent=True)
    assert base.begin(updates=2, persistent=True) is False  # a checkpoint load (update 1) came in between
    assert base.begin(updates=3, persistent=True) is True  # the full sync above is the next base


def test_targets_made_per_update_have_no_old_values() -> None:
    base = DeltaBase()
    base.begin(updates=0, persistent=True)
    assert base.begin(updates=1, persistent=False) is False
    assert base.begin(updates=2, persistent=True) is True


def test_only_a_delta_sync_leaves_derived_forms_of_unchanged_targets() -> None:
    assert unchanged_targets(3, ["a", "b"]) == frozenset({"a", "b"})
    assert unchanged_targets(None, ["a", "b"]) == frozenset()
