"""``python -m rollout_sync.bench NAME [args]``: forwards to ``python -m benchmarks NAME [args]`` in a checkout."""

from __future__ import annotations

import importlib
import sys


def main() -> int:
    try:
        forward = importlib.import_module("benchmarks.__main__")
    except ImportError:
        print("the benchmarks run from a checkout: cd into it and run python -m benchmarks", file=sys.stderr)
        return 2
    return int(forward.main(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
