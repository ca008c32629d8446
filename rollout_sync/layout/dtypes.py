"""Storage dtypes by name (``str(torch.dtype)`` without the ``torch.`` prefix) and their sizes in bytes.

Maps and plans carry dtypes as these names so that pure code never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype as maps and plans carry it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name; ``KeyError`` for a name this table does not know."""
    return ITEMSIZE[dtype]
