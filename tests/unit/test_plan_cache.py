"""Plans are cached by layout version; a changed layout builds a new plan."""

from __future__ import annotations

from rollout_sync.sync.fleet_plan import PlanCache, layout_version


def test_the_layout_version_changes_with_any_maps_digest_or_the_policy_and_not_with_peer_order():
    base = layout_version("t", [(2, 0, "a"), (3, 1, "b")], "balanced")
    assert base == layout_version("t", [(3, 1, "b"), (2, 0, "a")], "balanced")
    assert base != layout_version("t2", [(2, 0, "a"), (3, 1, "b")], "balanced")
    assert base != layout_version("t", [(2, 0, "a"), (3, 1, "c")], "balanced")
    assert base != layout_version("t", [(2, 0, "a"), (4, 1, "b")], "balanced")
    assert base != layout_version("t", [(2, 0, "a"), (3, 1, "b")], "lowest")
    assert layout_version("t", [], lambda request: 0) is None


def test_the_same_version_reuses_the_plan_and_another_builds_a_new_one():
    cache = PlanCache(capacity=2)
    built: list[str] = []

    def build(name: str):
        def make():
            built.append(name)
            return name  # stands in for a Plan: the cache never looks inside

        return make

    assert cache.get_or_build("v1", build("p1")) == ("p1", False)
    assert cache.get_or_build("v1", build("other")) == ("p1", True)
    assert cache.get_or_build("v2", build("p2")) == ("p2", False)
    assert cache.get_or_build("v3", build("p3")) == ("p3", False)  # evicts v1 (capacity 2)
    assert cache.get_or_build("v1", build("p1b")) == ("p1b", False)
    assert cache.get_or_build(None, build("p4")) == ("p4", False)  # no version: never cached
    assert cache.get_or_build(None, build("p5")) == ("p5", False)
    assert built == ["p1", "p2", "p3", "p1b", "p4", "p5"]
    assert (cache.hits, cache.misses) == (1, 6)
