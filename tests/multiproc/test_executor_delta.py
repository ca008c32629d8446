"""Delta syncs over gloo on 2–4 CPU ranks (one process each), on random planner plans: the first sync is full,
every later one sends only what changed and leaves every target bit for bit equal to its oracle, over 50
consecutive delta syncs with 0–60% of the elements changed (small steps, large jumps, sign flips, -0.0;
the fallback to full syncs off, so messages that changed a lot travel whole inside delta syncs); a rank
that did not commit, forgot its base, or runs without the option makes the next sync a full one on every
rank; a new executor (after a re-handshake) starts with a full sync; with the default fallback a sync after
a step that changed most weights is full, the next one refills the shadows, and deltas resume."""

from __future__ import annotations

from math import prod

import pytest
import torch
from test_executor_layouts import (
    MARGIN,
    POISON,
    Scenario,
    _dtype,
    _fill,
    bitwise_equal,
    random_scenario,
)

from rollout_sync.transport import ExecuteOptions, Executor, SyncStats
from tests.harness.ranks import run_on_ranks


class Stepped:
    """A scenario whose logical tensors change at every step: ``fraction`` of the elements of each, at random
    positions (the same on every rank, from the seed), by a small relative step, a large jump, a sign flip
    or a flip to -0.0."""

    def __init__(self, sc: Scenario, rank: int) -> None:
        self.sc = sc
        self.rank = rank
        self.values = {m.name: sc.logical(m.name).clone() for m in sc.sources}
        self.dtype_of = {m.name: m.dtype for m in sc.sources}
        self.sources = {
            m.name: torch.full(m.ranks[rank].shape, -7.0, dtype=_dtype(m.dtype))
            for m in sc.sources
            if rank in m.ranks
        }
        self.buffers: dict[str, torch.Tensor] = {}
        self.targets: dict[str, torch.Tensor] = {}
        for m in sc.targets:
            if rank in m.ranks:
                shape = m.ranks[rank].shape
                buf = torch.full((prod(shape) + 2 * MARGIN,), POISON, dtype=_dtype(m.dtype))
                self.buffers[m.name] = buf
                self.targets[m.name] = buf[MARGIN : MARGIN + prod(shape)].view(shape)
        self.fill()

    def fill(self) -> None:
        for m in self.sc.sources:
            if self.rank in m.ranks:
                _fill(self.sources[m.name], m, self.rank, self.values[m.name].to(_dtype(m.dtype)))

    def step(self, step: int, fraction: float) -> None:
        for i, (_name, full) in enumerate(sorted(self.values.items())):
            g = torch.Generator().manual_seed(self.sc.seed * 100_003 + step * 101 + i)
            flat = full.view(-1)
            n = round(fraction * flat.numel())
            at = torch.randperm(flat.numel(), generator=g)[:n]
            kind = torch.randint(0, 4, (n,), generator=g)
            noise = torch.randn(n, generator=g, dtype=torch.float64)
            old = flat[at]
            new = torch.where(kind == 0, old * (1 + 1e-2 * noise), old)
            new = torch.where(kind == 1, noise * 1000, new)
            new = torch.where(kind == 2, -old, new)
            new = torch.where(kind == 3, torch.full_like(old, -0.0), new)
            flat[at] = new
        self.fill()

    def expected(self) -> dict[str, torch.Tensor]:
        out = {}
        for m in self.sc.targets:
            if self.rank in m.ranks:
                shape = m.ranks[self.rank].shape
                buf = torch.full((prod(shape) + 2 * MARGIN,), POISON, dtype=_dtype(m.dtype))
                full = self.values[m.name].to(_dtype(self.dtype_of[m.name])).to(_dtype(m.dtype))
                _fill(buf[MARGIN : MARGIN + prod(shape)].view(shape), m, self.rank, full)
                out[m.name] = buf
        return out

    def wrong(self) -> list[str]:
        expected = self.expected()
        return sorted(n for n in expected if not bitwise_equal(expected[n], self.buffers[n]))


def _summary(stats: SyncStats) -> dict:
    return {
        "base": stats.delta_base,
        "sent": sum(stats.bytes_sent.values()),
        "received": sum(stats.bytes_received.values()),
        "compared": stats.elements_compared,
        "changed": stats.elements_changed,
        "state": stats.delta_state_bytes,
        "peak": stats.peak_staging_bytes,
    }


FRACTIONS = (0.0, 0.01, 0.1, 0.6, 0.002)


def _fifty_delta_syncs(rank: int, world: int, group, seed: int, options: ExecuteOptions) -> list[dict]:
    sc = random_scenario(seed, world, tensors=5)
    half = sc.plan().half(rank)
    state = Stepped(sc, rank)
    executor = Executor(group, options)
    out = []
    before = state.expected()
    for version in range(51):
        if version:
            state.step(version, FRACTIONS[version % len(FRACTIONS)])
        stats = executor.execute(half, state.sources, state.targets)
        wrong = state.wrong()
        assert not wrong, f"seed {seed} rank {rank} sync {version}: wrong target elements in {wrong}"
        # what a receiver reports unchanged holds exactly what it held before the sync
        now = state.expected()
        moved = sorted(n for n in stats.unchanged_targets if not bitwise_equal(now[n], before[n]))
        assert not moved, f"seed {seed} rank {rank} sync {version}: reported unchanged, but changed: {moved}"
        assert version or not stats.unchanged_targets  # a full sync writes every target
        before = now
        executor.committed(version)
        out.append({**_summary(stats), "unchanged": len(stats.unchanged_targets)})
    return out


@pytest.mark.parametrize(
    ("world", "seed", "options"),
    [
        (2, 31, ExecuteOptions(timeout=30, delta=True, delta_full_above=1.0)),
        (3, 32, ExecuteOptions(staging_cap_bytes=2048, timeout=30, delta=True, delta_full_above=1.0)),
        (
            4,
            33,
            ExecuteOptions(
                staging_cap_bytes=4096, timeout=30, overlap=False, delta=True, delta_full_above=1.0
            ),
        ),
    ],
)
def test_fifty_consecutive_delta_syncs_leave_every_target_equal_to_its_oracle(
    world: int, seed: int, options: ExecuteOptions
) -> None:
    results = run_on_ranks(_fifty_delta_syncs, world, seed, options, timeout=600)
    for per_rank in results:
        assert per_rank[0]["base"] is None  # the first sync is full
        assert [s["base"] for s in per_rank[1:]] == list(range(50))  # then each applies on the last
        assert all(s["peak"] <= options.staging_cap_bytes for s in per_rank)
    for k in range(51):
        sent = sum(results[r][k]["sent"] for r in range(world))
        assert sent == sum(results[r][k]["received"] for r in range(world))
    compared = sum(results[r][1]["compared"] for r in range(world))
    full = sum(results[r][0]["sent"] for r in range(world))
    assert compared > 0 and full > 0
    for k in range(1, 51):
        changed = sum(results[r][k]["changed"] for r in range(world))
        sent = sum(results[r][k]["sent"] for r in range(world))
        fraction = FRACTIONS[k % len(FRACTIONS)]
        if fraction == 0.0:
            assert changed == 0 and sent <= 16 * 400  # heads only
            assert sum(results[r][k]["unchanged"] for r in range(world)) > 0
        if fraction >= 0.5:
            assert changed > compared // 4
    senders = [r for r in range(world) if results[r][0]["sent"]]
    assert all(results[r][1]["state"] > 0 for r in senders)  # the shadow of what each sender sent


def _bases_after(rank: int, world: int, group, how: str) -> list[int | None]:
    """Three syncs; between the first and the second one rank (the last) misses its commit, forgets its
    base, or runs without the option; returns each sync's base on this rank."""
    sc = random_scenario(41, world, tensors=4)
    half = sc.plan().half(rank)
    state = Stepped(sc, rank)
    odd = rank == world - 1
    options = ExecuteOptions(timeout=30, delta=not (how == "option off" and odd), delta_full_above=1.0)
    executor = Executor(group, options)
    bases = []
    for version in range(4):
        if version:
            state.step(version, 0.05)
        stats = executor.execute(half, state.sources, state.targets)
        assert not state.wrong(), f"rank {rank} sync {version}"
        bases.append(stats.delta_base)
        if not (how == "missed commit" and odd and version == 1):
            executor.committed(version)
        if how == "forgot" and odd and version == 1:
            executor.forget_base()
        if how == "new executor" and version == 1:
            executor = Executor(group, options)
    return bases


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("missed commit", [None, 0, None, 2]),
        ("forgot", [None, 0, None, 2]),
        ("new executor", [None, 0, None, 2]),
        ("option off", [None, None, None, None]),
    ],
)
def test_a_rank_without_the_base_makes_the_next_sync_full_on_every_rank(how: str, expected: list) -> None:
    results = run_on_ranks(_bases_after, 3, how, timeout=300)
    assert all(bases == expected for bases in results), results


def _fallback(rank: int, world: int, group) -> list[tuple[int | None, float | None]]:
    sc = random_scenario(51, world, tensors=4)
    half = sc.plan().half(rank)
    state = Stepped(sc, rank)
    executor = Executor(group, ExecuteOptions(timeout=30, delta=True))
    out = []
    for version, fraction in enumerate((0.0, 0.01, 0.6, 0.01, 0.01)):
        if version:
            state.step(version, fraction)
        stats = executor.execute(half, state.sources, state.targets)
        assert not state.wrong(), f"rank {rank} sync {version}"
        executor.committed(version)
        out.append((stats.delta_base, stats.estimated_changed_share))
    return out


def test_a_step_that_changed_most_weights_is_synced_in_full_and_deltas_resume_after_it() -> None:
    results = run_on_ranks(_fallback, 3, timeout=300)
    assert all([base for base, _ in r] == [None, 0, None, None, 3] for r in results), results
    shares = [share for r in results for _, share in r[2:3] if share is not None]
    assert shares and max(shares) > 1 / 32  # the sender that saw it asked for the full sync
