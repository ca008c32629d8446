"""Typed errors. Every error about a layout names what was wrong: the logical tensor, the rank, the box,
and what was expected against what was found, so that a user can find the offending map without a debugger.

Bad input is a ``ValueError`` subclass (never an ``assert``); failures of peers are ``RuntimeError`` or
``TimeoutError`` subclasses.
"""

from __future__ import annotations

from typing import Any


class RolloutSyncError(Exception):
    """Base class of every error raised by rollout-sync."""


def _describe(
    message: str,
    tensor: str | None,
    rank: int | None,
    box: Any,
    expected: Any,
    found: Any,
) -> str:
    parts = [message]
    where = []
    if tensor is not None:
        where.append(f"tensor {tensor!r}")
    if rank is not None:
        where.append(f"rank {rank}")
    if box is not None:
        where.append(f"box {box}")
    if where:
        parts.append("(" + ", ".join(where) + ")")
    if expected is not None or found is not None:
        parts.append(f"expected {expected}, found {found}")
    return " ".join(parts[:2]) + (": " + parts[2] if len(parts) > 2 else "")


class LayoutError(RolloutSyncError, ValueError):
    """A map or a pair of maps that cannot be planned. Raised before any byte moves."""

    def __init__(
        self,
        message: str,
        *,
        tensor: str | None = None,
        rank: int | None = None,
        box: Any = None,
        expected: Any = None,
        found: Any = None,
    ) -> None:
        self.tensor = tensor
        self.rank = rank
        self.box = box
        self.expected = expected
        self.found = found
        self.reason = message
        super().__init__(_describe(message, tensor, rank, box, expected, found))


class OverlapError(LayoutError):
    """Two pieces of one storage address the same element."""


class HoleError(LayoutError):
    """A storage holds elements that no piece describes."""


class OutOfBoundsError(LayoutError):
    """A piece reaches past the end of its storage, or a box past the logical tensor."""


class NotAffineError(LayoutError):
    """A piece is not an affine view of its storage that the planner can address (for example an N-D box
    described in flat storage where it is not one dense run, or strides that step across storage axes)."""


class ShapeMismatchError(LayoutError):
    """Shapes, ranks of shapes, or dtypes disagree (two maps of one logical tensor, a box and its tensor)."""


class CoverageError(LayoutError):
    """A target element that no source holds, or a declared holder that does not hold its box."""


class UnsupportedLayoutError(LayoutError):
    """A legitimate layout this project does not express (a scale other than 1, offloaded storage, ...)."""


class TargetMismatchError(LayoutError):
    """Target maps built from a model's shapes disagree with what vLLM's own loaders do on the live engine
    (or with the full loader probe): names the tensor, the rank and the first wrong logical position."""


class ReplicaPolicyError(LayoutError):
    """A replica policy chose a rank that does not hold the box."""


class DryRunSpecError(LayoutError):
    """A dry-run description (model, trainer layout, rollout layout, bandwidths) that cannot be parsed or
    does not fit the model (sizes that do not divide, a TP size above the head count)."""


class WireFormatError(RolloutSyncError, ValueError):
    """A serialized map, plan or message that is malformed or speaks another format version."""


class PlanMismatchError(RolloutSyncError, RuntimeError):
    """Ranks disagree about the plan, or a rank lacks the storage its half needs. Raised on every rank."""


class StaleStorageError(PlanMismatchError):
    """DeepSpeed replaced a buffer that this rank's storage views alias (``load_checkpoint`` replaces the Adam
    states, a reallocated flat partition, a rebound ``param.data`` / ``ds_tensor``), and the views could not
    be re-derived under the maps the plan was built from. Nothing was sent: every rank of the sync refused
    it. Re-attach (``TrainerSync.attach`` again, with the rollout side connecting again) to plan anew."""

    def __init__(
        self,
        message: str,
        *,
        tensor: str | None = None,
        rank: int | None = None,
        expected: Any = None,
        found: Any = None,
    ) -> None:
        self.tensor = tensor
        self.rank = rank
        self.expected = expected
        self.found = found
        super().__init__(_describe(message, tensor, rank, None, expected, found))


class BackendDeviceError(RolloutSyncError, ValueError):
    """The sync group's backend cannot carry a rank's storages (gloo and CUDA tensors, NCCL and CPU
    tensors). Refused by the coordinator at the handshake, on every rank, before any byte moves."""


class TransportUnavailableError(BackendDeviceError):
    """The transport asked for cannot run here (the ``nixl`` transport without NIXL installed, an agent that
    cannot start, no interface for UCX): raised at the handshake, before any byte moves."""


class PeerFailedError(RolloutSyncError, RuntimeError):
    """A peer failed, died or refused during a sync."""


class StaleAnswerError(PeerFailedError):
    """An engine's worker answered a call with another call's answer (vLLM left a failed call's replies
    queued); the engine's calls are misaligned and it must be restarted."""


class SyncTimeoutError(RolloutSyncError, TimeoutError):
    """A wait ran past its timeout."""


class HandshakeError(RolloutSyncError, RuntimeError):
    """The handshake refused a peer (wrong token, another message version, an unexpected or duplicate
    peer) or was aborted by the coordinator."""


class IncompleteUpdateError(RolloutSyncError, RuntimeError):
    """A weight update on the rollout side cannot be completed correctly (for example it wrote only part of a
    parameter whose derived layout must be rebuilt from all of it). The new weight version is not claimed."""
