"""CUDA IPC through the driver API (``libcuda.so.1``, loaded by ctypes): export the handle of the device
allocation behind a storage, open a peer's handle, close it. Used by mapped handoffs (``mapped``) between
processes whose storages are on CUDA devices of one host: the receiver copies each segment straight from
the sender's allocation, device to device, with no host round trip.

Why the driver API and not ``torch.multiprocessing``'s storage sharing: that path keeps a reference-counter
file per process in ``/dev/shm``, left behind when the process is killed; a driver IPC handle is released by
the driver when either process ends, however it ends. Allocations of PyTorch's caching allocator are plain
``cuMemAlloc`` blocks (not with ``expandable_segments``), each exported whole: a storage is its block's
handle and its byte offset in the block.

Not yet run on a GPU here (no device lent so far): ``scripts/gpu_check.sh`` is the check to run on one.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["HANDLE_WORDS", "close", "export", "handle_of", "handle_words", "open_handle", "storage_at"]

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
HANDLE_WORDS = HANDLE_BYTES // 8
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

_cuda: ctypes.CDLL | None = None


class _Handle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes (bytes, not ``c_char``: a ``c_char`` array field reads back as
    a C string, cut at its first zero byte)."""

    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


def handle_words(handle: _Handle) -> list[int]:
    """A handle as ``HANDLE_WORDS`` signed 64-bit words (how a table row carries it)."""
    raw = ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES)
    return list(struct.unpack(f"<{HANDLE_WORDS}q", raw))


def handle_of(words: Sequence[int]) -> _Handle:
    """The handle ``handle_words`` gave those words for."""
    handle = _Handle()
    ctypes.memmove(ctypes.addressof(handle), struct.pack(f"<{HANDLE_WORDS}q", *words), HANDLE_BYTES)
    return handle


def _driver() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"the CUDA driver library (libcuda.so.1) cannot be loaded: {e}") from e
        lib.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for name in ("cuMemGetAddressRange_v2", "cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2"):
            getattr(lib, name).restype = ctypes.c_int
        lib.cuIpcCloseMemHandle.restype = ctypes.c_int
        _cuda = lib
    return _cuda


def _check(rc: int, what: str) -> None:
    if rc == 0:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(rc, ctypes.byref(name))
    raise RuntimeError(f"{what}: CUDA driver error {rc} ({(name.value or b'?').decode()})")


@contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """``device``'s primary context current on this thread while the driver API acts on it
    (``torch.cuda.device`` sets the device: cudaSetDevice makes the context, then puts the caller's device
    back)."""
    torch.cuda.init()
    with torch.cuda.device(device):
        yield


def export(tensor: torch.Tensor) -> tuple[list[int], int, int]:
    """The IPC handle (``HANDLE_WORDS`` signed 64-bit words) of the allocation behind ``tensor``'s storage,
    the storage's byte offset in it and the storage's bytes. Raises ``RuntimeError`` where the driver
    refuses (memory not from ``cuMemAlloc``, such as expandable segments)."""
    if tensor.device.type != "cuda":
        raise RuntimeError(f"a {tensor.device.type} storage has no CUDA IPC handle")
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    lib = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    handle = _Handle()
    with _on(tensor.device):
        _check(
            lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange"
        )
        _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    return handle_words(handle), ptr - base.value, storage.nbytes()


def open_handle(words: Sequence[int], device: torch.device) -> int:
    """Open a peer's allocation on ``device`` (this process's mapping of it): its base address."""
    handle = handle_of(words)
    ptr = ctypes.c_uint64()
    with _on(device):
        _check(
            _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, _LAZY_ENABLE_PEER_ACCESS),
            "cuIpcOpenMemHandle",
        )
    return int(ptr.value)


def close(ptr: int, device: torch.device) -> None:
    """Close this process's mapping of a peer's allocation (its views must be gone)."""
    with _on(device):
        _check(_driver().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


class _Interface:
    """A byte range of device memory as ``__cuda_array_interface__`` (how torch wraps foreign memory)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,  # C-contiguous
            "version": 2,
        }


def storage_at(ptr: int, nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """``nbytes`` of device memory at ``ptr`` as a storage that does not own it."""
    return torch.as_tensor(_Interface(ptr, nbytes), device=device).untyped_storage()
