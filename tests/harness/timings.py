"""Wall-clock figures the harness collects during a run (model builds, engine start-ups) so that the pytest
summary can print them. Figures only, never assertions: the machines here are shared and noisy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_RECORDS: list[tuple[str, float]] = []


def record(label: str, seconds: float) -> None:
    _RECORDS.append((label, seconds))


@contextmanager
def timed(label: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        record(label, time.perf_counter() - started)


def records() -> list[tuple[str, float]]:
    return list(_RECORDS)
