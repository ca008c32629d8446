"""Element sizes of the storage dtypes a plan may name (``str(torch.dtype)`` without ``torch.``).

Pure: the schedule needs byte counts on every rank, including ranks that hold no tensor of a dtype.
"""

from __future__ import annotations

ELEMENT_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
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


def element_size(dtype: str) -> int:
    """Bytes per element of ``dtype``. An unknown name raises ``KeyError``; callers check names first
    (``known_dtype``) and turn an unknown one into a refusal that every rank sees."""
    return ELEMENT_SIZES[dtype]


def known_dtype(dtype: str) -> bool:
    return dtype in ELEMENT_SIZES
