"""The planner against an element-by-element oracle that runs the plan the way the executor does: sources
filled with distinct values through ``torch.as_strided``, every segment applied in one process with
``as_strided`` copies, every target element compared with the logical tensor."""

from __future__ import annotations

from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_layouts import ANY, DEEPSPEED, ONLY_FLAT, ONLY_ND, layout_pairs, policies, shapes, tensor_maps

from rollout_sync.layout.maps import TensorMap
from rollout_sync.planning.plan import Plan
from rollout_sync.planning.planner import plan_model

torch = pytest.importorskip("torch")

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def logical(m: TensorMap):
    return torch.arange(1, m.numel + 1, dtype=torch.float64).reshape(m.shape)


def view(storage, extent, strides, offset):
    return torch.as_strided(storage, extent, strides, offset)


def region(full, origin, extent):
    return full[tuple(slice(o, o + e) for o, e in zip(origin, extent, strict=True))]


def fill_sources(m: TensorMap):
    full = logical(m)
    out = {}
    for rank, st_ in m.ranks.items():
        buf = torch.full(st_.shape, float("nan"), dtype=torch.float64)
        for p in st_.pieces:
            view(buf, p.box.extent, p.strides, p.offset).copy_(region(full, p.box.origin, p.box.extent))
        out[rank] = buf
    return out


def run_and_check(plan: Plan, sources: list[TensorMap], targets: list[TensorMap]) -> None:
    src = {m.name: fill_sources(m) for m in sources}
    tgt = {
        m.name: {r: torch.full(s.shape, -1.0, dtype=torch.float64) for r, s in m.ranks.items()}
        for m in targets
    }
    writes = {
        m.name: {r: torch.zeros(s.shape, dtype=torch.int64) for r, s in m.ranks.items()} for m in targets
    }
    for seg in plan.iter_segments():
        name = plan.tensors[seg.tensor].name
        data = view(src[name][seg.source_rank], seg.extent, seg.source_strides, seg.source_offset)
        view(tgt[name][seg.target_rank], seg.extent, seg.target_strides, seg.target_offset).copy_(data)
        view(writes[name][seg.target_rank], seg.extent, seg.target_strides, seg.target_offset).add_(1)
    for m in targets:
        full = logical(m)
        for rank, st_ in m.ranks.items():
            assert bool((writes[m.name][rank] == 1).all()), (
                f"{m.name} rank {rank}: an element written {writes}"
            )
            for p in st_.pieces:
                got = view(tgt[m.name][rank], p.box.extent, p.strides, p.offset)
                assert torch.equal(got, region(full, p.box.origin, p.box.extent)), (
                    f"{m.name} rank {rank} {p.box}"
                )
            assert prod(st_.shape) == 0 or bool((tgt[m.name][rank] > 0).all())


@SETTINGS
@given(layout_pairs(), policies())
def test_every_target_element_equals_the_logical_tensor_on_random_layouts(pair, policy):
    source, target = pair
    run_and_check(plan_model([source], [target], policy), [source], [target])


@SETTINGS
@given(
    st.sampled_from([(ONLY_FLAT, ONLY_ND), (ONLY_ND, ONLY_FLAT), (ONLY_FLAT, ONLY_FLAT)]).flatmap(
        lambda o: layout_pairs(o[0], o[1], min_ndim=2)
    ),
    policies(),
)
def test_flat_storage_on_either_or_both_sides(pair, policy):
    source, target = pair
    run_and_check(plan_model([source], [target], policy), [source], [target])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_whole_model_of_1d_to_4d_tensors(data):
    sources, targets = [], []
    for ndim in (1, 2, 3, 4):
        shape = data.draw(shapes(ndim, ndim, max_numel=200))
        opts = data.draw(st.sampled_from([ANY, DEEPSPEED, ONLY_FLAT]))
        sources.append(data.draw(tensor_maps(shape, 0, opts, name=f"t{ndim}")))
        targets.append(
            data.draw(tensor_maps(shape, data.draw(st.sampled_from([0, 50])), ANY, name=f"t{ndim}"))
        )
    plan = plan_model(sources, targets, data.draw(policies()))
    run_and_check(plan, sources, targets)
