"""The logical tensors of a saved checkpoint (names, shapes, dtypes), read from safetensors headers only.

``save_pretrained`` writes the logical-tensor namespace both sides speak; a vLLM worker reads it from the
directory it was started from, without loading any weight. ``read_tensors`` loads chosen tensors (for the
checkpoint path of a sync and for tests).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import WireFormatError

if TYPE_CHECKING:
    import torch

__all__ = ["SAFETENSORS_DTYPES", "logical_tensors", "read_tensors"]

# safetensors dtype codes -> the dtype names maps use (str(torch.dtype) without "torch.").
SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_MAX_HEADER = 100 * 2**20


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    return files


def _header(file: Path) -> dict[str, object]:
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WireFormatError(f"{file} is too short to be a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise WireFormatError(f"{file}: safetensors header of {size} bytes exceeds {_MAX_HEADER}")
        header = json.loads(f.read(size).decode())
    if not isinstance(header, dict):
        raise WireFormatError(f"{file}: safetensors header is not a JSON object")
    return header


def logical_tensors(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (shape, dtype)`` of every tensor in the checkpoint file or directory ``path``, in name
    order. Raises ``WireFormatError`` on a malformed header and ``ValueError`` on a name found twice."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in _files(Path(path)):
        for name, entry in _header(file).items():
            if name == "__metadata__":
                continue
            if not isinstance(entry, dict) or "shape" not in entry or "dtype" not in entry:
                raise WireFormatError(f"{file}: malformed safetensors entry for {name!r}")
            if name in out:
                raise ValueError(f"tensor {name!r} appears in two files of {path}")
            code = str(entry["dtype"])
            out[name] = (tuple(int(s) for s in entry["shape"]), SAFETENSORS_DTYPES.get(code, code.lower()))
    return dict(sorted(out.items()))


def read_tensors(path: str | Path, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for ``names`` (every tensor when None) from the checkpoint at ``path``, on CPU."""
    from safetensors import safe_open

    wanted = None if names is None else set(names)
    found: set[str] = set()
    for file in _files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if wanted is None or name in wanted:
                    found.add(name)
                    yield name, f.get_tensor(name)
    if wanted is not None and wanted - found:
        raise KeyError(f"tensors not in {path}: {sorted(wanted - found)[:5]}")
