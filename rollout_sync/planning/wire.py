"""The wire format of maps, plans and plan halves: versioned, compact, never pickled.

Layout of one message::

    b"RSYNC" | kind (1 byte: M maps, P plan, H half) | version (u16, big-endian) | flags (u8; bit 0: zlib)
    | body (zlib-compressed when flagged)

Bodies:

- maps: UTF-8 JSON ``{"maps": [[name, shape, dtype, [[rank, storage_shape, [[origin, extent, offset,
  strides, holders], ...]], ...]], ...]}``;
- plan: ``u32`` JSON length, JSON ``{"tables": [[[rank, storage_shape], ...], ...], "tensors": [[name,
  shape, source_dtype, target_dtype, source_table, target_table, segment_count], ...]}`` (storage tables
  are written once and referenced by index), then every tensor's segment records
  (``rollout_sync.planning.records``) as little-endian int64, tensor after tensor;
- half: ``u32`` JSON length, JSON ``{"rank", "digest", "table": {... as in a plan, counts 0 ...},
  "counts": [sends, receives, local]}``, then the segments as little-endian int64 records each prefixed by
  its tensor index.

A plan's digest is the sha256 of its canonical bytes: the header with flags 0 and the uncompressed body.
JSON is written with sorted keys and no spaces, so equal plans give equal bytes on every machine.
Decoding refuses another magic, kind or version, and any malformed body, with ``WireFormatError``; a map
that decodes but breaks the map rules raises the map's own ``LayoutError``.
"""

from __future__ import annotations

import json
import sys
import zlib
from array import array
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from ..errors import WireFormatError
from ..layout.box import Box
from ..layout.maps import Piece, RankStorage, TensorMap
from .canonical import (
    HEAD,
    KIND_HALF,
    KIND_MAPS,
    KIND_PLAN,
    MAGIC,
    U32,
    WIRE_VERSION,
    body_digest,
    ints_to_bytes,
    json_bytes,
    plan_digest,
    tensor_table_json,
)
from .half import PlanHalf
from .plan import Plan
from .records import PlannedTensor, Segment, check_segment, record_width

MAX_BODY_BYTES = 1 << 31

__all__ = [
    "WIRE_VERSION",
    "decode_half",
    "decode_maps",
    "decode_plan",
    "encode_half",
    "encode_maps",
    "encode_plan",
    "plan_digest",
]


# ---------------------------------------------------------------------------------------------- framing


def _frame(kind: bytes, body: bytes, compress: bool) -> bytes:
    if compress:
        return HEAD.pack(MAGIC, kind, WIRE_VERSION, 1) + zlib.compress(body, 1)
    return HEAD.pack(MAGIC, kind, WIRE_VERSION, 0) + body


def _unframe(data: bytes, kind: bytes) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"expected bytes, found {type(data).__name__}")
    data = bytes(data)
    if len(data) < HEAD.size:
        raise WireFormatError(f"message of {len(data)} bytes is shorter than the {HEAD.size}-byte header")
    magic, got_kind, version, flags = HEAD.unpack_from(data)
    if magic != MAGIC:
        raise WireFormatError(f"not a rollout-sync message (magic {magic!r}, expected {MAGIC!r})")
    if got_kind != kind:
        raise WireFormatError(f"expected a message of kind {kind!r}, found {got_kind!r}")
    if version != WIRE_VERSION:
        raise WireFormatError(
            f"wire format version {version} is not supported (this side speaks {WIRE_VERSION})"
        )
    if flags & ~1:
        raise WireFormatError(f"unknown header flags {flags:#x}")
    body = data[HEAD.size :]
    if flags & 1:
        try:
            inflater = zlib.decompressobj()
            body = inflater.decompress(body, MAX_BODY_BYTES)
            if inflater.unconsumed_tail or not inflater.eof:
                raise WireFormatError("compressed body is truncated or larger than the limit")
        except zlib.error as exc:
            raise WireFormatError(f"compressed body does not inflate: {exc}") from None
    return body


def _load_json(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireFormatError(f"body is not UTF-8 JSON: {exc}") from None


def _ints_from_bytes(raw: bytes) -> array:
    if len(raw) % 8:
        raise WireFormatError(f"integer section of {len(raw)} bytes is not a whole number of int64")
    values = array("q")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _split_json(body: bytes) -> tuple[Any, bytes]:
    if len(body) < U32.size:
        raise WireFormatError("body is shorter than its JSON length field")
    (n,) = U32.unpack_from(body)
    if U32.size + n > len(body):
        raise WireFormatError(f"JSON section of {n} bytes runs past the {len(body)}-byte body")
    return _load_json(body[U32.size : U32.size + n]), body[U32.size + n :]


# ---------------------------------------------------------------------------------------------- maps


def encode_maps(maps: Sequence[TensorMap], *, compress: bool = True) -> bytes:
    """Maps (in the given order) as wire bytes."""
    out = []
    for m in maps:
        ranks = []
        for rank, st in m.ranks.items():
            pieces = [
                [list(p.box.origin), list(p.box.extent), p.offset, list(p.strides), list(p.holders)]
                for p in st.pieces
            ]
            ranks.append([rank, list(st.shape), pieces])
        out.append([m.name, list(m.shape), m.dtype, ranks])
    return _frame(KIND_MAPS, json_bytes({"maps": out}), compress)


def decode_maps(data: bytes) -> tuple[TensorMap, ...]:
    """Maps from wire bytes; each is validated as it is built."""
    obj = _load_json(_unframe(data, KIND_MAPS))
    try:
        entries = obj["maps"]
        maps = []
        for name, shape, dtype, ranks in entries:
            table = {}
            for rank, sshape, pieces in ranks:
                built = tuple(
                    Piece(Box(_tup(o), _tup(e)), _int(off), _tup(s), _tup(h)) for o, e, off, s, h in pieces
                )
                table[_int(rank)] = RankStorage(_tup(sshape), built)
            maps.append((name, _tup(shape), dtype, table))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, WireFormatError) or _is_layout(exc):
            raise
        raise WireFormatError(f"malformed maps body: {exc!r}") from None
    return tuple(TensorMap(name, shape, dtype, table) for name, shape, dtype, table in maps)


def _is_layout(exc: BaseException) -> bool:
    from ..errors import LayoutError

    return isinstance(exc, LayoutError)


def _int(x: Any) -> int:
    if type(x) is not int:
        raise WireFormatError(f"expected an integer, found {x!r}")
    return x


def _tup(x: Any) -> tuple[int, ...]:
    if not isinstance(x, list) or any(type(v) is not int for v in x):
        raise WireFormatError(f"expected a list of integers, found {x!r}")
    return tuple(x)


# ---------------------------------------------------------------------------------------------- plans


def _tensors_from(obj: Any) -> list[tuple[PlannedTensor, int]]:
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("tensors"), list)
        or not isinstance(obj.get("tables"), list)
    ):
        raise WireFormatError("body has no tensor table")
    try:
        tables = []
        for rows in obj["tables"]:
            table = {}
            for rank, shape in rows:
                table[_int(rank)] = _tup(shape)
            if any(r < 0 for r in table) or any(min(s, default=0) < 0 for s in table.values()):
                raise WireFormatError(f"a storage table has a negative rank or size: {rows!r}")
            tables.append(MappingProxyType(dict(sorted(table.items()))))
        out = []
        for name, shape, sdt, tdt, si, ti, count in obj["tensors"]:
            if not isinstance(name, str) or not isinstance(sdt, str) or not isinstance(tdt, str):
                raise WireFormatError(f"malformed tensor entry for {name!r}")
            if not (0 <= _int(si) < len(tables) and 0 <= _int(ti) < len(tables)) or _int(count) < 0:
                raise WireFormatError(f"tensor {name!r} names a storage table or count that does not exist")
            out.append((PlannedTensor(name, _tup(shape), sdt, tdt, tables[si], tables[ti]), count))
        return out
    except (TypeError, ValueError) as exc:
        if isinstance(exc, WireFormatError) or _is_layout(exc):
            raise
        raise WireFormatError(f"malformed tensor table: {exc!r}") from None


def encode_plan(plan: Plan, *, compress: bool = True) -> bytes:
    """A plan as wire bytes (and, as a side effect, the plan's digest, from the same canonical body)."""
    return _frame(KIND_PLAN, plan.canonical_body(), compress)


def decode_plan(data: bytes) -> Plan:
    """A plan from wire bytes, validated (ranks and views against the tensor table)."""
    body = _unframe(data, KIND_PLAN)
    obj, rest = _split_json(body)
    ints = _ints_from_bytes(rest)
    tensors = []
    records = []
    pos = 0
    for t, count in _tensors_from(obj):
        n = count * record_width(len(t.shape))
        if pos + n > len(ints):
            raise WireFormatError(f"segment records of tensor {t.name!r} run past the end of the body")
        tensors.append(t)
        records.append(ints[pos : pos + n])
        pos += n
    if pos != len(ints):
        raise WireFormatError(f"{len(ints) - pos} integers after the last tensor's records")
    return Plan.from_records(tensors, records, digest=body_digest(body))


# ---------------------------------------------------------------------------------------------- halves


def encode_half(half: PlanHalf, *, compress: bool = True) -> bytes:
    """One rank's half as wire bytes (with the whole plan's tensor table and digest)."""
    head = json_bytes(
        {
            "rank": half.rank,
            "digest": half.digest,
            "table": json.loads(tensor_table_json(half.tensors, [0] * len(half.tensors))),
            "counts": [len(half.sends), len(half.receives), len(half.local)],
        }
    )
    ints = array("q")
    for group in (half.sends, half.receives, half.local):
        for s in group:
            ints.extend(
                (
                    s.tensor,
                    s.source_rank,
                    s.source_offset,
                    s.target_rank,
                    s.target_offset,
                    *s.source_strides,
                    *s.target_strides,
                    *s.extent,
                )
            )
    return _frame(KIND_HALF, U32.pack(len(head)) + head + ints_to_bytes(ints), compress)


def decode_half(data: bytes) -> PlanHalf:
    """A half from wire bytes; segments are checked against the tensor table as they are built."""
    obj, rest = _split_json(_unframe(data, KIND_HALF))
    try:
        rank = _int(obj["rank"])
        digest = obj["digest"]
        counts = [_int(c) for c in obj["counts"]]
        tensors = tuple(t for t, _ in _tensors_from(obj["table"]))
        if not isinstance(digest, str) or len(counts) != 3:
            raise WireFormatError("malformed half header")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, WireFormatError) or _is_layout(exc):
            raise
        raise WireFormatError(f"malformed half header: {exc!r}") from None
    ints = _ints_from_bytes(rest)
    groups: list[list[Segment]] = [[], [], []]
    pos = 0
    for g, count in enumerate(counts):
        for _ in range(count):
            if pos >= len(ints):
                raise WireFormatError("half segments run past the end of the body")
            ti = ints[pos]
            if not 0 <= ti < len(tensors):
                raise WireFormatError(f"a half segment names tensor {ti}, the table has {len(tensors)}")
            n = len(tensors[ti].shape)
            w = record_width(n)
            if pos + 1 + w > len(ints):
                raise WireFormatError("half segments run past the end of the body")
            r = ints[pos + 1 : pos + 1 + w]
            seg = Segment(
                ti,
                r[0],
                r[1],
                tuple(r[4 : 4 + n]),
                r[2],
                r[3],
                tuple(r[4 + n : 4 + 2 * n]),
                tuple(r[4 + 2 * n :]),
            )
            check_segment(tensors[ti], seg)
            groups[g].append(seg)
            pos += 1 + w
    if pos != len(ints):
        raise WireFormatError(f"{len(ints) - pos} integers after the last segment of the half")
    return PlanHalf(rank, digest, tensors, tuple(groups[0]), tuple(groups[1]), tuple(groups[2]))
