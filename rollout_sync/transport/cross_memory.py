"""Pulls from another process's memory on this host (Linux cross-memory attach: ``process_vm_readv``).

A receiver on the same host as its sender copies a dense segment straight from the sender's source storage
into its own target storage: one copy, made by the receiver alone, no staging on either side. The kernel
allows it when the reader may ptrace the sender (same user; under Yama's ``ptrace_scope`` 1 the sender
must name its readers: ``allow_pulls`` lets any process of the user read it) and no seccomp filter blocks
the call. Whether a pair can pull is found by a probe at its first sync (``executor``), not assumed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Sequence

__all__ = ["IOV_MAX", "allow_pulls", "pull", "supported"]

IOV_MAX = 1024
"""Iovecs per ``process_vm_readv`` call (the kernel's ``UIO_MAXIOV``)."""

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
    return _libc


def supported() -> bool:
    """Whether this platform has the call at all (Linux with a C library)."""
    lib = _lib()
    return lib is not None and hasattr(lib, "process_vm_readv")


def allow_pulls() -> None:
    """Let other processes of this user read this process (Yama ``ptrace_scope`` 1); best effort."""
    lib = _lib()
    if lib is not None:
        lib.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def pull(pid: int, runs: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(local address, remote address, bytes)`` run from process ``pid`` into this process.
    Raises ``OSError`` (with the errno) when the kernel refuses or the process is gone."""
    lib = _lib()
    if lib is None:
        raise OSError(38, "process_vm_readv is not available on this platform")
    for start in range(0, len(runs), IOV_MAX):
        batch = runs[start : start + IOV_MAX]
        local = (_Iovec * len(batch))(*[_Iovec(a, n) for a, _, n in batch])
        remote = (_Iovec * len(batch))(*[_Iovec(r, n) for _, r, n in batch])
        want = sum(n for _, _, n in batch)
        got = lib.process_vm_readv(pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"process_vm_readv from pid {pid}: {os.strerror(errno)}")
        if got != want:  # a partial read: the remote range ended early (unmapped)
            raise OSError(14, f"process_vm_readv from pid {pid} read {got} of {want} bytes")
