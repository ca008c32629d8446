"""A call run on its own thread, joined within a timeout: the rollout half of a sync runs beside the
trainer half in the same process (a served engine's HTTP call, or a colocated vLLM worker's receive)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import SyncTimeoutError

__all__ = ["Background"]


class Background:
    def __init__(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.name = name
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the joining thread
                self.error = exc

        self.thread = threading.Thread(target=run, name=f"rollout-sync {name}", daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> Any:
        """The call's result; its exception re-raised; ``SyncTimeoutError`` if it has not ended in time."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise SyncTimeoutError(f"{self.name} did not end within {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.result
