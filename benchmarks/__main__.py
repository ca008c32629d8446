"""Dispatch ``python -m benchmarks NAME [args] [--record [NOTE]]`` to ``benchmarks.NAME.main(args)``.

``--record`` appends the figures the benchmark printed last (its ``--json`` line) to ``benchmarks/results/``
as one record with the machine, the commit and the date (``benchmarks.records``); ``--note TEXT`` goes with
it. Run from a checkout: ``benchmarks/`` is not installed.
"""

from __future__ import annotations

import importlib
import io
import pkgutil
import sys
from typing import TextIO

import benchmarks as bench_pkg

from .records import last_json, write_record

NOT_BENCHMARKS = ("records", "render")


class _Tee(io.TextIOBase):
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.seen = io.StringIO()

    def write(self, text: str) -> int:
        self.seen.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = sorted(
        m.name
        for m in pkgutil.iter_modules(bench_pkg.__path__)
        if not m.name.startswith("_") and m.name not in NOT_BENCHMARKS
    )
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print(
            f"usage: python -m benchmarks {{{','.join(names)}}} [--json] [...] [--record [--note TEXT]]",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, args = argv[0], argv[1:]
    record = "--record" in args
    note = ""
    if "--note" in args:
        i = args.index("--note")
        note = args[i + 1] if i + 1 < len(args) else ""
        del args[i : i + 2]
    args = [a for a in args if a != "--record"]
    module = importlib.import_module(f"benchmarks.{name}")
    if not record:
        return int(module.main(args) or 0)
    if "--json" not in args:
        args.append("--json")
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        status = int(module.main(args) or 0)
    finally:
        sys.stdout = tee.out
    figures = last_json(tee.seen.getvalue())
    if status == 0 and figures is not None:
        print(f"[benchmarks] recorded {write_record(name, args, figures, note)}", file=sys.stderr)
    else:
        print(
            f"[benchmarks] nothing recorded (exit {status}, figures: {figures is not None})", file=sys.stderr
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
