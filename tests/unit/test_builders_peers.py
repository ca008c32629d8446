"""The layout facts the pure builders encode, checked against the installed DeepSpeed and vLLM functions
that decide them (no engine is started; skipped where the package is missing)."""

from __future__ import annotations

import os

import pytest

from rollout_sync.geometry.deepspeed import autotp_shard_sizes, zero3_partition_numel
from rollout_sync.geometry.vllm import vllm_expert_owner, vllm_vocab_rows


@pytest.fixture(scope="module")
def tp_shard():  # type: ignore[no-untyped-def]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.module_inject.tp_shard")


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize(
    ("total", "name", "kv"),
    [
        (4096, "model.layers.0.self_attn.q_proj", 8),
        (1024, "model.layers.0.self_attn.k_proj", 8),
        (4096, "model.layers.0.self_attn.o_proj", 8),
        (12288, "model.layers.0.mlp.gate_proj", 8),
        (12288, "model.layers.0.mlp.down_proj", 8),
        (151936, "lm_head", 8),
        (1000, "lm_head", 2),
        (96, "model.layers.1.mlp.up_proj", 2),
        (100, "model.layers.0.self_attn.q_proj", 3),
        (64, "model.layers.0.self_attn.q_proj", None),
    ],
)
@pytest.mark.parametrize("grain", [1, 64])
def test_autotp_sizes_equal_deepspeeds_get_shard_size(
    tp_shard, tp: int, total: int, name: str, kv: int | None, grain: int
) -> None:  # type: ignore[no-untyped-def]
    meta = tp_shard.AutoTPMeta(num_kv_heads=kv, tp_grain_size=grain)
    expected = tuple(tp_shard.get_shard_size(total, tp, meta, name=name, rank=r) for r in range(tp))
    assert autotp_shard_sizes(total, tp, name, kv, grain) == expected


class _FakeDist:
    """Just enough of ``deepspeed.comm`` for DeepSpeed's group builders to record their rank lists."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank

    def get_world_size(self, group: object = None) -> int:
        return self.world

    def get_rank(self, group: object = None) -> int:
        return self.rank

    def is_initialized(self) -> bool:
        return True

    def new_group(self, ranks: object) -> tuple[int, ...]:
        return tuple(ranks)  # type: ignore[call-overload]


@pytest.mark.parametrize(("dp", "tp"), [(4, 2), (2, 4), (3, 1), (1, 3)])
def test_deepspeed_autotp_groups_follow_the_trainer_rank_table(
    monkeypatch: pytest.MonkeyPatch, dp: int, tp: int
) -> None:
    """DeepSpeed's explicit (data_parallel, tensor_parallel) group builder, run with a recording fake
    ``dist``: every rank's TP and DP groups are the rows and columns of ``trainer_rank_table``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    groups = pytest.importorskip("deepspeed.utils.groups")
    from rollout_sync.geometry.deepspeed import trainer_rank_table

    table = trainer_rank_table(dp, tp)
    for rank in range(dp * tp):
        monkeypatch.setattr(groups, "dist", _FakeDist(dp * tp, rank))
        monkeypatch.setattr(groups, "_DATA_PARALLEL_GROUP", None)
        monkeypatch.setattr(groups, "_TENSOR_MODEL_PARALLEL_GROUP", None)
        monkeypatch.setattr(groups, "_MODEL_PARALLEL_GROUP", None)
        dp_group, tp_group = groups._init_tp_groups_with_new_group(tp, dp)
        tp_rank, dp_rank = rank % tp, rank // tp
        assert table[tp_rank][dp_rank] == rank
        assert dp_group == table[tp_rank]
        assert tp_group == tuple(table[t][dp_rank] for t in range(tp))


@pytest.mark.parametrize(("world", "ep"), [(4, 2), (8, 4), (6, 3)])
def test_deepspeed_expert_groups_put_ep_ranks_on_consecutive_ranks(
    monkeypatch: pytest.MonkeyPatch, world: int, ep: int
) -> None:
    """``_create_expert_and_data_parallel`` (legacy path, no TP): EP rank = rank % ep, expert-DP groups
    strided by ep, which ``trainer_maps`` assumes for AutoEP."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    groups = pytest.importorskip("deepspeed.utils.groups")
    monkeypatch.setattr(groups, "log_dist", lambda *a, **k: None)
    monkeypatch.setattr(groups, "mpu", None)
    for rank in range(world):
        monkeypatch.setattr(groups, "dist", _FakeDist(world, rank))
        monkeypatch.setattr(groups, "_EXPERT_DATA_PARALLEL_GROUP", {})
        monkeypatch.setattr(groups, "_EXPERT_DATA_PARALLEL_GROUP_RANKS", {})
        monkeypatch.setattr(groups, "_EXPERT_PARALLEL_GROUP", {})
        monkeypatch.setattr(groups, "_EXPERT_PARALLEL_GROUP_RANKS", {})
        groups._create_expert_and_data_parallel(ep)
        name = f"ep_size_{ep}"
        assert groups._EXPERT_PARALLEL_GROUP[name] == tuple(range(rank - rank % ep, rank - rank % ep + ep))
        assert groups._EXPERT_DATA_PARALLEL_GROUP[name] == tuple(range(rank % ep, world, ep))


def test_zero3_partition_size_equals_deepspeeds_padding_rule() -> None:
    """ZeRO-3 (``partition_parameters.py``): aligned size = numel + (dp - numel % dp) % dp, partition =
    aligned // dp."""
    for numel in (1, 5, 35, 36, 4096 * 4096 + 3):
        for dp in (1, 2, 3, 4, 7, 8):
            remainder = numel % dp
            padding = remainder and (dp - remainder)
            assert zero3_partition_numel(numel, dp) == (numel + padding) // dp


@pytest.fixture(scope="module")
def vocab_module():  # type: ignore[no-untyped-def]
    return pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")


@pytest.mark.parametrize(
    ("vocab", "tp"), [(1000, 1), (1000, 2), (1000, 4), (151936, 8), (163840, 16), (100, 2)]
)
def test_vocab_rows_equal_vllms_shard_indices(vocab_module, vocab: int, tp: int) -> None:  # type: ignore[no-untyped-def]
    padded = vocab_module.pad_vocab_size(vocab, 64)
    for r, (start, stop) in enumerate(vllm_vocab_rows(vocab, tp)):
        idx = vocab_module.VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, r, tp)
        assert (idx.org_vocab_start_index, idx.org_vocab_end_index) == (start, stop)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize(("experts", "ep"), [(8, 2), (8, 3), (128, 8), (384, 7)])
def test_expert_owner_equals_vllms_expert_map(placement: str, experts: int, ep: int) -> None:
    manager = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")
    for r in range(ep):
        _, expert_map, _ = manager.determine_expert_map(ep, r, experts, placement)
        for e in range(experts):
            local = int(expert_map[e])
            owner, index = vllm_expert_owner(e, experts, ep, placement)
            assert (owner == r) == (local >= 0)
            if local >= 0:
                assert index == local
