"""``python -m testbed KIND PATH [--seed N]``: build one tiny checkpoint (no download)."""

from __future__ import annotations

import argparse

from testbed.tiny_models import TINY_KINDS, make_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed",
        description="Build a tiny Qwen3 checkpoint locally (no download).",
    )
    parser.add_argument("kind", choices=TINY_KINDS)
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_model(args.kind, args.path, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
