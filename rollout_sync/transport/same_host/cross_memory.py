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

import torch

__all__ = ["IOV_MAX", "allow_pulls", "pull", "pull_iov", "supported"]

IOV_MAX = 1024
"""Iovecs per ``process_vm_readv`` call (the kernel's ``UIO_MAXIOV``)."""

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
        if hasattr(lib, "process_vm_readv"):
            fn = lib.process_vm_readv
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong]
            fn.argtypes += [ctypes.c_ulong]
            fn.restype = ctypes.c_ssize_t
        _libc = lib
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


def pull_iov(pid: int, local: torch.Tensor, remote: torch.Tensor) -> None:
    """Copy bytes from process ``pid`` into this process: ``local`` and ``remote`` are int64 tensors of
    shape ``(n, 2)`` and ``(m, 2)``, each row ``(address, bytes)`` (the layout of ``struct iovec``), with the
    same total: the concatenation of the remote ranges lands in the concatenation of the local ones. Either
    ``n == m`` (row ``i`` of each has the same length) or one side is a single range (the kernel pins the
    other process's pages once per remote range: a single remote range is the fast case). Raises
    ``OSError`` (with the errno) when the kernel refuses or the process is gone."""
    lib = _lib()
    if lib is None or not hasattr(lib, "process_vm_readv"):
        raise OSError(38, "process_vm_readv is not available on this platform")
    local, remote = local.contiguous(), remote.contiguous()
    n, m = local.shape[0], remote.shape[0]
    if n != m and 1 not in (n, m):
        raise ValueError(f"pull_iov pairs {n} local ranges with {m} remote ones")
    many = local if n >= m else remote
    lengths = many[:, 1]
    single_at = int(remote[0, 0]) if n >= m else int(local[0, 0])
    done = 0
    for start in range(0, max(n, m), IOV_MAX):
        k = min(IOV_MAX, max(n, m) - start)
        want = int(lengths[start : start + k].sum())
        if n == m:
            lp, rp, kl, kr = local.data_ptr() + start * 16, remote.data_ptr() + start * 16, k, k
        else:
            one = torch.tensor([single_at + done, want], dtype=torch.int64)
            if n > m:
                lp, rp, kl, kr = local.data_ptr() + start * 16, one.data_ptr(), k, 1
            else:
                lp, rp, kl, kr = one.data_ptr(), remote.data_ptr() + start * 16, 1, k
        got = lib.process_vm_readv(pid, lp, kl, rp, kr, 0)
        if got < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"process_vm_readv from pid {pid}: {os.strerror(errno)}")
        if got != want:  # a partial read: the remote range ended early (unmapped)
            raise OSError(14, f"process_vm_readv from pid {pid} read {got} of {want} bytes")
        done += want


def pull(pid: int, runs: Sequence[tuple[int, int, int]]) -> None:
    """``pull_iov`` of ``(local address, remote address, bytes)`` runs."""
    rows = torch.tensor([[a, r, n] for a, r, n in runs], dtype=torch.int64).reshape(-1, 3)
    pull_iov(pid, rows[:, [0, 2]], rows[:, [1, 2]])
