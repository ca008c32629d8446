"""Run a callback after every applied optimizer step of a DeepSpeed engine.

DeepSpeed has no post-step callback, so the hook wraps the engine's own ``step`` method (on the instance,
never the class). A step counts only when DeepSpeed applied it (``engine.was_step_applied()``): calls between
gradient-accumulation boundaries and steps skipped for overflow do not. With ``every=N`` the callback runs
after every N-th applied step. The callback receives the engine's ``global_steps`` as the weight version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepHook:
    def __init__(self, engine: Any, callback: Callable[[int], None], *, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, found {every}")
        if getattr(engine, "_rollout_sync_step_hook", None) is not None:
            raise ValueError("this DeepSpeed engine already has a rollout-sync step hook attached")
        self.engine = engine
        self.callback = callback
        self.every = every
        self.applied_steps = 0
        self._original = engine.step
        engine.step = self._step
        engine._rollout_sync_step_hook = self

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        result = self._original(*args, **kwargs)
        if self.engine.was_step_applied():
            self.applied_steps += 1
            if self.applied_steps % self.every == 0:
                self.callback(int(self.engine.global_steps))
        return result

    def detach(self) -> None:
        """Restore the engine's own step method."""
        if self.engine.step == self._step:
            del self.engine.step
        self.engine._rollout_sync_step_hook = None
