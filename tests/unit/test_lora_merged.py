"""Merged LoRA syncs, in one process with real PEFT (no process group): each "rank" merges only the flat
partition of every base weight it stores, as ZeRO-3 holds them (partitions that start and end inside rows),
and the union of the partitions equals PEFT's own ``merge_and_unload`` bit for bit. The shapes include
Qwen3-0.6B's MLP, where a block of rows of ``B @ A`` computed alone differs in the last bit from the same rows
of the whole product (measured with torch's CPU GEMM), so merging a rank's rows alone would not match."""

from __future__ import annotations

import pytest
import torch

from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.layout.runs import flat_run_boxes
from rollout_sync.trainer.adapter import adapter_config
from rollout_sync.trainer.merged import MergedSources, merged_storage, merged_tensor_name

peft = pytest.importorskip("peft")

SHAPES = {"up": (3072, 1024), "down": (1024, 3072), "odd": (130, 70)}
RANK = 16
CONFIG = {"r": RANK, "lora_alpha": 24, "target_modules": list(SHAPES), "lora_dropout": 0.0}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, (out, inp) in SHAPES.items():
            setattr(self, name, torch.nn.Linear(inp, out, bias=False))


def _peft_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = peft.get_peft_model(_Model(), peft.LoraConfig(**CONFIG)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape) * 0.2)
    return model


def _flat_storage(shape: tuple[int, int], start: int, stop: int, rank: int) -> RankStorage:
    pieces, at = [], 0
    for box in flat_run_boxes(shape, start, stop):
        pieces.append(Piece(box, at, (shape[1], 1), (rank,)))
        at += box.numel
    return RankStorage((stop - start,), tuple(pieces))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merged_partitions_equal_peft_merge_and_unload_bit_for_bit(dtype):
    """In fp32 (no cast of the product) a single row of ``B @ A`` computed alone differs from the whole
    product's in the last bit: the partitions' one-row boxes catch a rank that multiplies only its rows."""
    model = _peft_model(dtype)
    params = dict(model.named_parameters())
    world = 3
    merged_parts: dict[str, list[torch.Tensor]] = {}
    for rank in range(world):
        maps, views = [], {}
        for name, p in params.items():
            if merged_tensor_name(name) is None:
                continue
            shape = tuple(p.shape)
            n = p.numel()
            start, stop = n * rank // world + 7 * rank, n * (rank + 1) // world + 7 * (rank + 1)
            start, stop = min(start, n), min(stop, n) if rank < world - 1 else n
            storage = _flat_storage(shape, start, stop, rank)
            maps.append(TensorMap(name, shape, str(dtype).removeprefix("torch."), {rank: storage}))
            views[name] = p.data.view(-1)[start:stop]
        maps, views = merged_storage(maps, views)
        config = adapter_config({"default": {"peft_type": "LORA", **CONFIG}})
        sources = MergedSources(model, maps, views, config, rank).refresh(views)
        for name in SHAPES:
            merged_parts.setdefault(f"{name}.weight", []).append(sources[f"{name}.weight"].clone())
    reference = dict(model.merge_and_unload().named_parameters())
    for name, parts in merged_parts.items():
        got = torch.cat(parts).view(reference[name].shape)
        assert torch.equal(got, reference[name].data), f"{name}: merged partitions differ from PEFT's merge"


def test_merged_names_drop_the_adapter_and_peft_s_prefixes():
    assert merged_tensor_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert merged_tensor_name("base_model.model.model.norm.weight") == "model.norm.weight"
    assert merged_tensor_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") is None
