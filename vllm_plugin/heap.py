"""Rebuilding a kernel's form in the host memory its predecessor released (glibc's allocator).

A rebuild lets go of a layer's old kernel form and at once allocates the new one, of the same size. glibc
serves an allocation above its mmap threshold (32 MiB at most) with fresh pages from the operating system
and unmaps it when it is freed, so a form that large is faulted in page by page at every sync. Measured
(2-core AVX-512 EPYC, one thread, 2026-12-04): vLLM's oneDNN handle for Qwen3-0.6B's tied lm_head at TP 2
(155.6 MB) took 37,985 page faults and 145-167 ms per build, 79-80 ms when built in memory the process
already held; a 101 MB linear weight (12288 x 4096, as Qwen3-8B's gate_up at TP 2) 24,577 faults and
114-136 ms, 67-74 ms; the 112 smaller linear layers of Qwen3-0.6B (6-12 MB, below the threshold) took none.

``reusing_released_memory`` makes glibc serve allocations from its heap for the duration (``M_MMAP_MAX``
0) and keep what is freed there (``M_TRIM_THRESHOLD`` 2 GiB), so from the second rebuild on the new
form takes the pages the old one released: no fresh memory, no more resident memory than before. Any
``mallopt`` stops glibc's dynamic thresholds where they are, so on leaving it sets them to where that rule
ends up once a 32 MiB block has been freed: mmap threshold 32 MiB, trim threshold 64 MiB, 65,536 mappings
(left where they were, a process that had not yet freed a large block would keep mapping every allocation
above 128 KiB afresh: measured, a 6 MB oneDNN handle then took 1,537 page faults and 7.3-8.1 ms per build
instead of none and 3.7 ms). Allocations of other threads meanwhile come from their own arenas, which
still map what does not fit. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
from collections.abc import Iterator
from typing import Any

__all__ = ["reusing_released_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_DEFAULT_MMAP_MAX = 65536
_MMAP_AFTER = 32 << 20  # the most glibc's dynamic mmap threshold reaches (and the most mallopt takes)
_TRIM_AFTER = 2 * _MMAP_AFTER  # its dynamic trim threshold at that point
_KEEP_FREED = 2**31 - 1  # the most mallopt takes (an int): free heap memory up to 2 GiB stays

_mallopt: Any = None


def _glibc_mallopt() -> Any:
    """glibc's ``mallopt``, or False where the process does not run on glibc."""
    global _mallopt
    if _mallopt is None:
        _mallopt = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                fn = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):
                fn = None
            if fn is not None:
                fn.argtypes = [ctypes.c_int, ctypes.c_int]
                fn.restype = ctypes.c_int
                _mallopt = fn
    return _mallopt


@contextlib.contextmanager
def reusing_released_memory() -> Iterator[None]:
    """Within: the calling thread's large allocations reuse freed heap memory instead of fresh pages."""
    mallopt = _glibc_mallopt()
    if not mallopt:
        yield
        return
    mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED)
    mallopt(_M_MMAP_MAX, 0)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_AFTER)
        mallopt(_M_TRIM_THRESHOLD, _TRIM_AFTER)
        mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
