"""Plans: every point-to-point copy (segment) of a whole model's sync.

A **plan** holds all segments of a model (``planning.records``), sorted deterministically; a rank's
**half** (``planning.half``) is the segments it sends plus those it receives.

A ``Plan`` stores its segments columnar (one ``array('q')`` of fixed-width integer records per tensor, in
the layout ``planning.records`` describes) so that plans of millions of segments stay small;
``segments``, ``tensor_segments`` and ``half`` hand out ``Segment`` objects, and ``records`` gives the raw
integers for code that wants to avoid the objects.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from math import prod

from ..errors import PlanMismatchError, ShapeMismatchError
from ..layout.dtypes import ITEMSIZE
from .canonical import body_digest, plan_body, plan_digest
from .half import PlanHalf
from .records import PlannedTensor, Segment, check_record, record_width

__all__ = ["Plan"]


class Plan:
    """All segments of a model's sync: ``tensors`` (the tensor table), ``segments`` (sorted by tensor,
    then target rank, target offset, source rank, source offset), ``digest`` (sha256 hex of the canonical
    wire bytes) and ``half(rank)``.

    ``Plan(tensors, segments)`` validates every segment against the tensor table (ranks present, views
    inside their storages) and sorts them; ``Plan.from_records`` takes the columnar form directly.
    Immutable.
    """

    __slots__ = ("_digest", "_index", "_records", "_segments", "_tensors")

    def __init__(self, tensors: Sequence[PlannedTensor], segments: Iterable[Segment]) -> None:
        tensors = tuple(tensors)
        rows: list[list[tuple[int, ...]]] = [[] for _ in tensors]
        for s in segments:
            if not 0 <= s.tensor < len(tensors):
                raise PlanMismatchError(f"segment {s} names tensor {s.tensor}, the plan has {len(tensors)}")
            rows[s.tensor].append(
                (
                    s.source_rank,
                    s.source_offset,
                    s.target_rank,
                    s.target_offset,
                    *s.source_strides,
                    *s.target_strides,
                    *s.extent,
                )
            )
        records = []
        for i, r in enumerate(rows):
            r.sort(key=lambda x: (x[2], x[3], x[0], x[1]))
            ndim = len(tensors[i].shape)
            for x in r:
                if len(x) != record_width(ndim):
                    raise ShapeMismatchError(
                        "a segment's ndim differs from its tensor's", tensor=tensors[i].name, expected=ndim
                    )
            records.append(array("q", [v for x in r for v in x]))
        self._init(tensors, tuple(records))
        self.validate()

    @classmethod
    def from_records(
        cls,
        tensors: Sequence[PlannedTensor],
        records: Sequence[array],
        *,
        validate: bool = True,
        digest: str | None = None,
    ) -> Plan:
        """A plan from its columnar form (one ``array('q')`` of records per tensor, in the order the plan
        keeps). ``validate=False`` is for the planner, whose records are valid by construction; ``digest``
        is the digest of the canonical bytes the records were decoded from (``planning.wire``)."""
        plan = cls.__new__(cls)
        plan._init(tuple(tensors), tuple(records))
        plan._digest = digest
        if validate:
            plan.validate()
        return plan

    def _init(self, tensors: tuple[PlannedTensor, ...], records: tuple[array, ...]) -> None:
        if len(records) != len(tensors):
            raise PlanMismatchError(f"{len(records)} record arrays for {len(tensors)} tensors")
        self._tensors = tensors
        self._records = records
        self._digest: str | None = None
        self._index: list[tuple[frozenset[int], frozenset[int]]] | None
        self._index = None
        self._segments: tuple[Segment, ...] | None = None

    def validate(self) -> None:
        """Check every record: its ranks are in the tensor's storage tables and both views stay inside
        their storages (offset + Σ (extent−1)·stride < numel). Raises ``PlanMismatchError`` /
        ``OutOfBoundsError`` naming the tensor and rank."""
        for i, t in enumerate(self._tensors):
            rec = self._records[i]
            n = len(t.shape)
            w = record_width(n)
            if len(rec) % w:
                raise PlanMismatchError(
                    f"tensor {t.name!r}: {len(rec)} integers is not a whole number of records"
                )
            snumel = {r: prod(s) for r, s in t.source_storage.items()}
            tnumel = {r: prod(s) for r, s in t.target_storage.items()}
            for k in range(0, len(rec), w):
                check_record(t, snumel, tnumel, rec[k : k + w])

    # ------------------------------------------------------------------ reading

    @property
    def tensors(self) -> tuple[PlannedTensor, ...]:
        return self._tensors

    def records(self, tensor: int) -> array:
        """The raw records of one tensor (layout in ``planning.records``). Do not modify."""
        return self._records[tensor]

    def segment_count(self, tensor: int | None = None) -> int:
        if tensor is not None:
            return len(self._records[tensor]) // record_width(len(self._tensors[tensor].shape))
        return sum(
            len(r) // record_width(len(t.shape)) for r, t in zip(self._records, self._tensors, strict=True)
        )

    def __len__(self) -> int:
        return self.segment_count()

    def _segment(self, i: int, k: int) -> Segment:
        rec = self._records[i]
        n = len(self._tensors[i].shape)
        return Segment(
            i,
            rec[k],
            rec[k + 1],
            tuple(rec[k + 4 : k + 4 + n]),
            rec[k + 2],
            rec[k + 3],
            tuple(rec[k + 4 + n : k + 4 + 2 * n]),
            tuple(rec[k + 4 + 2 * n : k + 4 + 3 * n]),
        )

    def tensor_segments(self, tensor: int) -> tuple[Segment, ...]:
        w = record_width(len(self._tensors[tensor].shape))
        return tuple(self._segment(tensor, k) for k in range(0, len(self._records[tensor]), w))

    def iter_segments(self) -> Iterator[Segment]:
        """Every segment in plan order, made on the fly (no tuple of all segments is kept)."""
        for i, t in enumerate(self._tensors):
            w = record_width(len(t.shape))
            for k in range(0, len(self._records[i]), w):
                yield self._segment(i, k)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Every segment in plan order (built once, then kept; prefer ``iter_segments`` or ``half`` for very
        large plans)."""
        if self._segments is None:
            self._segments = tuple(self.iter_segments())
        return self._segments

    @property
    def digest(self) -> str:
        """sha256 (hex) of the plan's canonical wire bytes: equal on every rank that holds the same plan."""
        if self._digest is None:
            self._digest = plan_digest(self)
        return self._digest

    def canonical_body(self) -> bytes:
        """The plan's canonical body (``planning.canonical``); building it also fixes the digest."""
        body = plan_body(self)
        if self._digest is None:
            self._digest = body_digest(body)
        return body

    def _rank_sets(self) -> list[tuple[frozenset[int], frozenset[int]]]:
        """Per tensor, the source ranks and the target ranks of its segments (built once)."""
        if self._index is None:
            sets = []
            shared: dict[
                int, tuple[frozenset[int], frozenset[int]]
            ] = {}  # tensors may share one record array
            for i, t in enumerate(self._tensors):
                rec = self._records[i]
                got = shared.get(id(rec))
                if got is None:
                    w = record_width(len(t.shape))
                    got = shared[id(rec)] = (frozenset(rec[0::w]), frozenset(rec[2::w]))
                sets.append(got)
            self._index = sets
        return self._index

    def half(self, rank: int) -> PlanHalf:
        """The segments ``rank`` sends, receives and copies locally, in plan order.

        Cheap: the first call notes which ranks each tensor's segments involve (one pass over the records
        in C); a half then visits only the tensors that involve ``rank``."""
        sets = self._rank_sets()
        sends: list[Segment] = []
        receives: list[Segment] = []
        local: list[Segment] = []
        seg = self._segment
        for i, (srcs, tgts) in enumerate(sets):
            if rank not in srcs and rank not in tgts:
                continue
            rec = self._records[i]
            w = record_width(len(self._tensors[i].shape))
            for k in range(0, len(rec), w):
                src = rec[k]
                tgt = rec[k + 2]
                if src == rank:
                    (local if tgt == rank else sends).append(seg(i, k))
                elif tgt == rank:
                    receives.append(seg(i, k))
        return PlanHalf(
            rank=rank,
            digest=self.digest,
            tensors=self._tensors,
            sends=tuple(sends),
            receives=tuple(receives),
            local=tuple(local),
        )

    def ranks(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(source ranks, target ranks) that appear in at least one segment, increasing."""
        src: set[int] = set()
        tgt: set[int] = set()
        for srcs, tgts in self._rank_sets():
            src |= srcs
            tgt |= tgts
        return tuple(sorted(src)), tuple(sorted(tgt))

    # ------------------------------------------------------------------ statistics

    def _bytes(self, by: int, dtype_of: str, include_local: bool) -> dict[int, int]:
        out: dict[int, int] = {}
        for i, t in enumerate(self._tensors):
            rec = self._records[i]
            n = len(t.shape)
            w = record_width(n)
            size = ITEMSIZE[getattr(t, dtype_of)]
            for k in range(0, len(rec), w):
                if not include_local and rec[k] == rec[k + 2]:
                    continue
                numel = 1
                for e in rec[k + 4 + 2 * n : k + w]:
                    numel *= e
                r = rec[k + by]
                out[r] = out.get(r, 0) + numel * size
        return dict(sorted(out.items()))

    def bytes_by_source_rank(self, *, include_local: bool = True) -> dict[int, int]:
        """Bytes each source rank reads (in the source dtype); without local copies if asked."""
        return self._bytes(0, "source_dtype", include_local)

    def bytes_by_target_rank(self, *, include_local: bool = True) -> dict[int, int]:
        """Bytes each target rank receives (in the target dtype); without local copies if asked."""
        return self._bytes(2, "target_dtype", include_local)

    def local_bytes(self) -> int:
        """Bytes (source dtype) copied within one rank."""
        everything = sum(self.bytes_by_source_rank().values())
        return everything - sum(self.bytes_by_source_rank(include_local=False).values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self._tensors == other._tensors and self._records == other._records

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Plan({len(self._tensors)} tensors, {self.segment_count()} segments)"
