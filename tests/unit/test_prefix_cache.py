"""``vllm_plugin.prefix_cache``: a new weight version evicts every cached block from the prefix cache's index
(pure logic over stand-ins for vLLM's engine core and block pool; the real engine: tests/vllm/test_inflight.py)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_plugin.prefix_cache import forget_prefixes, wrap


class _Manager:
    def __init__(self, hashed: list[bool]) -> None:
        self.block_pool = SimpleNamespace(
            blocks=[SimpleNamespace(block_id=i, block_hash="h" if h else None) for i, h in enumerate(hashed)]
        )
        self.evicted: list[set[int]] = []

    def evict_blocks(self, ids: set[int]) -> None:
        self.evicted.append(set(ids))


class _Core:
    def __init__(self) -> None:
        self._weight_version = "default"
        self.scheduler = SimpleNamespace(kv_cache_manager=_Manager([False, True, True, False, True]))

    def set_weight_version(self, version: str) -> None:
        self._weight_version = version


def test_a_new_version_forgets_every_cached_block_and_the_same_version_forgets_nothing() -> None:
    core = _Core()
    set_version = wrap(_Core.set_weight_version)
    set_version(core, "1")
    assert core._weight_version == "1" and core.scheduler.kv_cache_manager.evicted == [{1, 2, 4}]
    set_version(core, "1")
    assert core.scheduler.kv_cache_manager.evicted == [{1, 2, 4}]


def test_an_engine_core_without_the_expected_internals_is_left_alone() -> None:
    assert forget_prefixes(SimpleNamespace()) == -1
