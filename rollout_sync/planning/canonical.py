"""The canonical bytes of a plan and its digest: the header (flags 0) and the uncompressed body that
``planning.wire`` sends (see there for the layout). A plan's digest is the sha256 of these bytes, so equal
plans give equal digests on every machine. Pure; knows plans only by their attributes, so ``planning.plan``
can compute its own digest and ``planning.wire`` can frame the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import Plan
    from .records import PlannedTensor

MAGIC = b"RSYNC"
WIRE_VERSION = 1
KIND_MAPS = b"M"
KIND_PLAN = b"P"
KIND_HALF = b"H"

HEAD = struct.Struct(">5scHB")
U32 = struct.Struct(">I")

__all__ = ["body_digest", "plan_body", "plan_digest"]


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def ints_to_bytes(values: array) -> bytes:
    if sys.byteorder == "big":
        values = array("q", values)
        values.byteswap()
    return values.tobytes()


class StorageTables:
    """Storage tables (rank -> storage shape) written once and referenced by index: the tensors of a model
    share a handful of them."""

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self._by_id: dict[int, int] = {}
        self._by_content: dict[tuple[tuple[int, tuple[int, ...]], ...], int] = {}
        self._keep: list[Mapping[int, tuple[int, ...]]] = []  # keep ids valid while encoding

    def index(self, table: Mapping[int, tuple[int, ...]]) -> int:
        got = self._by_id.get(id(table))
        if got is not None:
            return got
        content = tuple(sorted(table.items()))
        got = self._by_content.get(content)
        if got is None:
            got = self._by_content[content] = len(self.rows)
            self.rows.append([[r, list(shape)] for r, shape in content])
        self._by_id[id(table)] = got
        self._keep.append(table)
        return got


def tensor_table_json(tensors: Sequence[PlannedTensor], counts: Sequence[int]) -> bytes:
    """The JSON of a tensor table: storage tables written once and referenced by index."""
    tables = StorageTables()
    entries = [
        [
            t.name,
            list(t.shape),
            t.source_dtype,
            t.target_dtype,
            tables.index(t.source_storage),
            tables.index(t.target_storage),
            count,
        ]
        for t, count in zip(tensors, counts, strict=True)
    ]
    return json_bytes({"tables": tables.rows, "tensors": entries})


def plan_body(plan: Plan) -> bytes:
    n = len(plan.tensors)
    head = tensor_table_json(plan.tensors, [plan.segment_count(i) for i in range(n)])
    ints = b"".join(ints_to_bytes(plan.records(i)) for i in range(n))
    return U32.pack(len(head)) + head + ints


def body_digest(body: bytes) -> str:
    """sha256 hex of a plan's canonical bytes, given its uncompressed body."""
    h = hashlib.sha256(HEAD.pack(MAGIC, KIND_PLAN, WIRE_VERSION, 0))
    h.update(body)
    return h.hexdigest()


def plan_digest(plan: Plan) -> str:
    """sha256 hex of the plan's canonical bytes (uncompressed, flags 0)."""
    return body_digest(plan_body(plan))
