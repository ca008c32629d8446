"""``vllm_plugin.heap``: a kernel's form rebuilt right after its predecessor was released takes the
predecessor's pages instead of fresh ones (glibc). Each case runs in a fresh interpreter, so that this test
process's allocator settings stay as they were and glibc's thresholds start from their defaults."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="reusing_released_memory tunes glibc's allocator; elsewhere it does nothing",
)

# A "rebuild": free the old form, allocate the new one of the same size, write every page of it.
_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    from vllm_plugin.heap import reusing_released_memory

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    SIZE = int(sys.argv[1])

    def rebuild(old):
        libc.free(old)
        new = libc.malloc(SIZE)
        ctypes.memset(new, 1, SIZE)
        return new

    def faults(step):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = step()
        return out, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def windowed(old):
        with reusing_released_memory():
            return rebuild(old)

    form = rebuild(None)
    form, plain = faults(lambda: rebuild(form))
    form, first = faults(lambda: windowed(form))  # moves the form from its own mapping into the heap
    counts = []
    for _ in range(3):
        form, n = faults(lambda: windowed(form))
        counts.append(n)
    # after the window: a 6 MB block, below the threshold set on leaving, is served from the heap again
    small = libc.malloc(6 << 20)
    ctypes.memset(small, 1, 6 << 20)
    libc.free(small)
    small = libc.malloc(6 << 20)
    _, again = faults(lambda: ctypes.memset(small, 2, 6 << 20))
    print(json.dumps({"plain": plain, "first": first, "reused": counts, "small_again": again}))
    """
)


def _run(size: int) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(size)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_a_large_form_is_rebuilt_in_the_pages_its_predecessor_released() -> None:
    size = 96 << 20  # above glibc's largest mmap threshold (32 MiB): mapped afresh at every plain rebuild
    pages = size // 4096
    found = _run(size)
    plain = found["plain"]
    assert isinstance(plain, int) and plain >= 0.9 * pages, found  # the cost this module removes
    reused = found["reused"]
    assert isinstance(reused, list) and all(n < 0.01 * pages for n in reused), found
    # leaving the window leaves glibc serving mid-sized blocks from its heap, not from fresh mappings
    small_again = found["small_again"]
    assert isinstance(small_again, int) and small_again < 0.1 * (6 << 20) // 4096, found
