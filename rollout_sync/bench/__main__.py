"""Dispatch ``python -m rollout_sync.bench NAME [args]`` to ``rollout_sync.bench.NAME.main(args)``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import rollout_sync.bench as bench_pkg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if not m.name.startswith("_"))
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print(f"usage: python -m rollout_sync.bench {{{','.join(names)}}} [--json] [...]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"rollout_sync.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
