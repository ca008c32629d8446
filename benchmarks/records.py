"""Results as data: one JSON record per benchmark run in ``benchmarks/results/``.

A record is ``{"bench", "command", "date", "commit", "machine", "note", "figures"}``: ``machine`` names the
CPU kind vLLM behaves by (``amx``, ``avx512``, ``avx2``), its flags that matter here, its cores and model
name; ``figures`` is the JSON the benchmark printed last. ``python -m benchmarks NAME --record ...`` appends
one; ``python -m benchmarks.render`` turns them into the table the README and the docs show.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what decides vLLM's CPU kernels


def cpu_kind(flags: Iterable[str]) -> str:
    have = set(flags)
    return "amx" if "amx_tile" in have else "avx512" if "avx512f" in have else "avx2"


def machine() -> dict[str, Any]:
    flags: list[str] = []
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "cpu": cpu_kind(flags),
        "flags": [f for f in FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)),
        "described": model,
    }


def commit() -> str | None:
    """The checkout's commit, ``+dirty`` where tracked files differ from it (None outside a checkout)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def last_json(printed: str) -> dict[str, Any] | None:
    """The last line of ``printed`` that is a JSON object (every benchmark prints its figures last)."""
    for line in reversed(printed.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def write_record(bench: str, argv: list[str], figures: dict[str, Any], note: str = "") -> Path:
    """Append one record to ``benchmarks/results/`` as ``BENCH-CPU-DATE[-N].json``; returns its path."""
    now = datetime.datetime.now(datetime.timezone.utc)
    box = machine()
    record = {
        "bench": bench,
        "command": " ".join(["python -m benchmarks", bench, *argv]),
        "date": now.date().isoformat(),
        "commit": commit(),
        "machine": box,
        "note": note,
        "figures": figures,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = f"{bench}-{box['cpu']}-{record['date']}"
    path = RESULTS / f"{stem}.json"
    n = 1
    while path.exists():
        n += 1
        path = RESULTS / f"{stem}-{n}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def load_records(folder: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every record in ``folder`` by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
