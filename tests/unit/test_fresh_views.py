"""The decision before each sync, when a buffer behind the storage views was replaced: re-derive under the
same maps, or refuse with a typed error naming the tensor and the rank (fakes for the watch and the engine's
description; real DeepSpeed engines are in tests/deepspeed/test_stale_views.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_sync.errors import LayoutError, PlanMismatchError, StaleStorageError
from rollout_sync.layout.builders import replicated_map
from rollout_sync.planning.wire import encode_maps
from rollout_sync.sync.fleet_plan import maps_digest
from rollout_sync.trainer.fresh_views import FreshViews

MAPS = [replicated_map("w", (4, 8), "bfloat16", [0, 1])]
DIGEST = maps_digest(encode_maps(MAPS))


@dataclass
class Stale:
    names: tuple[str, ...]

    def describe(self) -> str:
        return f"buffer of {self.names[0]} replaced"


@dataclass
class FakeWatch:
    replaced: list[Stale] = field(default_factory=list)
    calls: int = 0

    def stale(self) -> list[Stale]:
        self.calls += 1
        return self.replaced


def test_views_whose_buffers_are_all_still_held_are_kept_without_describing_the_engine_again():
    def rebuild():
        raise AssertionError("no buffer was replaced: nothing to re-derive")

    watch = FakeWatch()
    views = FreshViews({"w": "old view"}, watch, DIGEST, rebuild, rank=1)
    assert views.check() is None
    assert views.sources == {"w": "old view"} and views.rederived == 0 and watch.calls == 1


def test_a_replaced_buffer_under_unchanged_maps_swaps_in_the_re_derived_views():
    new_watch = FakeWatch()
    views = FreshViews(
        {"w": "old view"},
        FakeWatch([Stale(("w",))]),
        DIGEST,
        lambda: (MAPS, {"w": "new view"}, new_watch),
        rank=0,
    )
    assert views.check() is None
    assert views.sources == {"w": "new view"} and views.watch is new_watch and views.rederived == 1
    assert views.check() is None and new_watch.calls == 1  # the next check asks the new watch


def test_a_replaced_buffer_under_changed_maps_is_refused_naming_the_tensor_and_the_rank():
    other = [replicated_map("w", (4, 8), "float32", [0, 1])]
    views = FreshViews(
        {"w": "old view"},
        FakeWatch([Stale(("w",))]),
        DIGEST,
        lambda: (other, {"w": "new view"}, FakeWatch()),
        rank=1,
    )
    error = views.check()
    assert isinstance(error, StaleStorageError) and isinstance(error, PlanMismatchError)
    assert error.tensor == "w" and error.rank == 1
    assert "re-attach" in str(error) and DIGEST[:12] in str(error)
    assert views.sources == {"w": "old view"} and views.rederived == 0


def test_an_engine_that_can_no_longer_be_described_is_refused_with_the_reason():
    def rebuild():
        raise LayoutError("a parameter is not a view of its flat buffer", tensor="w", rank=0)

    views = FreshViews({"w": "old view"}, FakeWatch([Stale(("w",))]), DIGEST, rebuild, rank=0)
    error = views.check()
    assert isinstance(error, StaleStorageError)
    assert "not a view of its flat buffer" in str(error) and error.rank == 0


def test_views_without_a_watch_are_never_checked():
    views = FreshViews({"w": "view"}, None, DIGEST, None, rank=0)
    assert views.check() is None


def test_a_replaced_buffer_without_a_way_to_describe_the_engine_again_is_refused():
    views = FreshViews({"w": "view"}, FakeWatch([Stale(("w",))]), DIGEST, None, rank=3)
    error = views.check()
    assert isinstance(error, StaleStorageError) and error.rank == 3 and error.tensor == "w"
