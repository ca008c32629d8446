"""The step hook fires after applied optimizer steps only (a stand-in engine: pure logic of the hook)."""

from __future__ import annotations

import pytest

from rollout_sync.trainer.step_hook import StepHook


class Engine:
    """Mimics DeepSpeed's step(): an optimizer step is applied at every `accumulation`-th call, unless the
    step overflows."""

    def __init__(self, accumulation: int = 1) -> None:
        self.accumulation = accumulation
        self.calls = 0
        self.global_steps = 0
        self._applied = False
        self.overflow_next = False

    def step(self) -> str:
        self.calls += 1
        self._applied = False
        if self.calls % self.accumulation == 0:
            if self.overflow_next:
                self.overflow_next = False
            else:
                self._applied = True
            self.global_steps += 1
        return "stepped"

    def was_step_applied(self) -> bool:
        return self._applied


def test_the_callback_runs_only_at_gradient_accumulation_boundaries():
    engine = Engine(accumulation=2)
    versions: list[int] = []
    StepHook(engine, versions.append)
    for _ in range(6):
        assert engine.step() == "stepped"
    assert versions == [1, 2, 3]


def test_every_n_counts_applied_steps_and_skips_overflowed_ones():
    engine = Engine()
    versions: list[int] = []
    StepHook(engine, versions.append, every=2)
    engine.step()
    engine.overflow_next = True
    engine.step()  # skipped: overflow
    engine.step()
    engine.step()
    engine.step()
    assert versions == [3, 5]


def test_a_second_hook_is_refused_and_detach_restores_the_engine():
    engine = Engine()
    hook = StepHook(engine, lambda v: None)
    with pytest.raises(ValueError, match="already has a rollout-sync step hook"):
        StepHook(engine, lambda v: None)
    hook.detach()
    assert "step" not in vars(engine)
    StepHook(engine, lambda v: None)
