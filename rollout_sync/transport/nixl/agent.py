"""One process's NIXL agent for group-free pulls (``rollout-sync[nixl]``): registered storages, the agent
metadata the handshake carries, reads of descriptor rows from a peer's registered memory, and short
notifications. The only module that imports NIXL (``nixl_cu12``, or ``nixl`` where only that is installed).

UCX is set up from the route to the coordinator, as the group path sets gloo and NCCL up: unless the user set
them, ``UCX_NET_DEVICES`` is the interface that route leaves by and ``UCX_TLS`` is ``tcp`` (two machines, or
two containers on one, must not take each other for one host: UCX would otherwise read through CMA or shared
memory by pid), with 256 KiB TCP segments (``UCX_TCP_TX_SEG_SIZE``/``RX``: 2-3x over the 8 KiB default). A
user who runs on RDMA or GPUs sets ``UCX_TLS`` (and ``UCX_NET_DEVICES``) to what the fabric has. UCX reads
them once, when the first agent of the process starts.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import PeerFailedError, SyncTimeoutError, TransportUnavailableError
from ..core.network import interface_of

__all__ = ["NixlAgent", "ucx_environment"]

UCX_DEFAULTS = {"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}
POLL_S = 0.0005
#: How long ``add_peer`` keeps trying to connect to a peer that NIXL cannot reach yet.
REACH_S = 10.0


def _nixl() -> Any:
    for module in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise TransportUnavailableError(
        "the 'nixl' transport needs NIXL: pip install 'rollout-sync[nixl]' "
        "(or: pip install --no-deps nixl-cu12 numpy)"
    )


def available() -> bool:
    try:
        _nixl()
    except TransportUnavailableError:
        return False
    return True


def ucx_environment(bind: str) -> dict[str, str]:
    """Set UCX's variables for a process whose route to the coordinator leaves from local address ``bind``
    (what the user set wins); returns what this process now runs with."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if "UCX_NET_DEVICES" not in os.environ:
        name = interface_of(bind)
        if name is None:
            raise TransportUnavailableError(
                f"no network interface holds {bind}, the address this process reaches the coordinator "
                "from: set UCX_NET_DEVICES to the interface NIXL should use"
            )
        os.environ["UCX_NET_DEVICES"] = name
    return {k: os.environ[k] for k in (*UCX_DEFAULTS, "UCX_NET_DEVICES")}


def _memory(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


@dataclass
class Reading:
    """Reads posted to one peer (``wait`` completes them)."""

    peer: str
    handle: Any
    nbytes: int


PROGRESS_DELAY_ENV = "ROLLOUT_SYNC_NIXL_PROGRESS_DELAY_US"
PROGRESS_DELAY_US = 10_000
"""How long NIXL's UCX progress thread may sleep in ``poll`` between events. It wakes at once when data or a
request arrives; the delay only bounds a wakeup UCX failed to signal. NIXL's Python agent sets 0, which makes
the thread spin a whole core in every process that holds an agent (measured: a vLLM worker's thread at
100 % system time, starving the engine on a 2-core host, and the handshake stalled behind it)."""

_patch = threading.Lock()


class _Bindings:
    """NIXL's bindings module, except that the agent it makes has ``pthrDelay`` = ``delay_us``."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def nixlAgent(self, name: str, config: Any) -> Any:  # the bindings' name
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)


def _new_agent(nixl: Any, name: str) -> Any:
    """``nixl.agent(name)`` with a UCX backend and a progress thread that waits for events (not one that
    spins: ``PROGRESS_DELAY_US``)."""
    delay = int(os.environ.get(PROGRESS_DELAY_ENV, PROGRESS_DELAY_US))
    api: Any = sys.modules[nixl.nixl_agent.__module__]
    config = nixl.nixl_agent_config(backends=["UCX"])
    with _patch:
        real = api.nixlBind
        api.nixlBind = _Bindings(real, delay)
        try:
            return nixl.nixl_agent(name, config)
        finally:
            api.nixlBind = real


class NixlAgent:
    """A named NIXL agent with a UCX backend. ``register`` pins storages once (each underlying storage one
    region, whatever views of it are passed); reads name memory by address, so a region must stay registered
    (and alive) while any peer may still read it."""

    def __init__(self, name: str) -> None:
        nixl = _nixl()
        try:
            self.agent = _new_agent(nixl, name)
        except Exception as exc:  # the bindings raise their own types
            raise TransportUnavailableError(f"NIXL agent {name!r} could not start: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise TransportUnavailableError(
                f"NIXL agent {name!r} has no UCX backend (plugins: {self.agent.plugin_list})"
            )
        self.name = name
        self.regions: dict[tuple[str, int, int], tuple[int, int]] = {}  # (memory, device, start) -> end, kept
        self._registered: list[tuple[Any, Any]] = []  # descriptor lists and what they keep alive
        self.peers: dict[str, str] = {}  # agent name -> the same (added remote agents)
        self._notes: dict[str, list[bytes]] = {}

    def register(self, tensors: Iterable[torch.Tensor]) -> int:
        """Register the storages of ``tensors`` not registered yet; returns the bytes newly registered."""
        added = 0
        rows: dict[str, list[tuple[int, int, int]]] = {}
        keep: list[Any] = []
        for t in tensors:
            storage = t.untyped_storage()
            start, nbytes = storage.data_ptr(), storage.nbytes()
            memory, device = _memory(t)
            if nbytes == 0 or self.covers(t):
                continue
            self.regions[(memory, device, start)] = (start + nbytes, device)
            rows.setdefault(memory, []).append((start, nbytes, device))
            keep.append(storage)
            added += nbytes
        for memory, descs in rows.items():
            reg = self.agent.register_memory([(a, n, d, "") for a, n, d in descs], memory)
            self._registered.append((reg, keep))
        return added

    def covers(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in one registered region."""
        memory, device = _memory(t)
        start = t.untyped_storage().data_ptr()
        region = self.regions.get((memory, device, start))
        return region is not None and start + t.untyped_storage().nbytes() <= region[0]

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, label: str | None = None, within: float = REACH_S) -> str:
        """Add a peer's agent from its metadata; ``label``: how errors name it (a rank and its host). NIXL
        connects to the peer here: where it cannot (UCX: "Destination is unreachable", seen right after a
        cut link came back), it is tried again for ``within`` seconds, then ``PeerFailedError`` names it."""
        deadline = time.monotonic() + within
        while True:
            try:
                name = self.agent.add_remote_agent(metadata)
                break
            except Exception as exc:  # nixl's own error types (nixlBackendError, ...): named below
                if time.monotonic() > deadline:
                    raise PeerFailedError(
                        f"{label or 'a peer'}: NIXL could not connect to its agent within {within:g} s "
                        f"({type(exc).__name__}: {exc}); its host unreachable, a link down, or the peer gone"
                    ) from exc
                time.sleep(0.2)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.peers[name] = label or name
        return name

    def label(self, peer: str) -> str:
        """How errors name ``peer``: its rank and host where known, else its agent's name."""
        return self.peers.get(peer, peer)

    def connect(self, peer: str) -> None:
        """Connect ahead of the first read (it would otherwise connect, tens of ms idle, over 1 s under load)."""
        self.agent.make_connection(peer)

    def read(
        self,
        peer: str,
        local: Sequence[Sequence[int]] | Any,
        remote: Sequence[Sequence[int]] | Any,
        memory: str = "DRAM",
        notify: bytes = b"",
    ) -> Reading:
        """Post one batch of reads from ``peer``: row ``i`` reads ``remote[i]`` (address, bytes, device)
        into ``local[i]`` (the same bytes); ``notify`` reaches the peer once every row has landed."""
        import numpy as np

        local_rows = np.asarray(local, dtype=np.int64).reshape(-1, 3)
        remote_rows = np.asarray(remote, dtype=np.int64).reshape(-1, 3)
        nbytes = int(local_rows[:, 1].sum())
        try:
            local_descs = self.agent.get_xfer_descs(local_rows, memory)
            remote_descs = self.agent.get_xfer_descs(remote_rows, memory)
            handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, peer, notify)
            state = self.agent.transfer(handle)
        except Exception as exc:
            raise PeerFailedError(
                f"NIXL agent {self.name}: reading {nbytes} bytes from {self.label(peer)} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise PeerFailedError(
                f"NIXL agent {self.name}: reading {nbytes} bytes from {self.label(peer)} failed at once"
            )
        return Reading(peer, handle, nbytes)

    def wait(self, readings: Sequence[Reading], deadline: float, what: str) -> None:
        """Wait until every reading is done, raising (``PeerFailedError`` naming the peer, or
        ``SyncTimeoutError`` at ``deadline``, a ``time.monotonic`` value); every handle is released."""
        pending = list(readings)
        try:
            while pending:
                for r in list(pending):
                    try:
                        state = self.agent.check_xfer_state(r.handle)
                    except Exception as exc:
                        raise PeerFailedError(
                            f"{what}: reading from {self.label(r.peer)} failed: {type(exc).__name__}: {exc}"
                        ) from exc
                    if state == "DONE":
                        pending.remove(r)
                        self.agent.release_xfer_handle(r.handle)
                    elif state == "ERR":
                        raise PeerFailedError(
                            f"{what}: reading {r.nbytes} bytes from {self.label(r.peer)} failed"
                        )
                if pending and time.monotonic() > deadline:
                    late = ", ".join(sorted({self.label(r.peer) for r in pending}))
                    raise SyncTimeoutError(f"{what}: reads from {late} did not complete in time")
                if pending:
                    time.sleep(POLL_S)
        finally:
            for r in pending:  # a transfer that cannot be cancelled is left to the agent's end
                with contextlib.suppress(Exception):
                    self.agent.release_xfer_handle(r.handle)

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, message)
        except Exception as exc:
            raise PeerFailedError(
                f"NIXL agent {self.name}: notifying {self.label(peer)} failed: {exc}"
            ) from exc

    def notes(self) -> dict[str, list[bytes]]:
        """The notifications that arrived since the last call, by the sending agent's name."""
        got = self.agent.get_new_notifs()
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): [bytes(m) for m in v] for k, v in got.items()
        }

    def close(self) -> None:
        for reg, _ in self._registered:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)
        self._registered.clear()
        self.regions.clear()
        for peer in list(self.peers):
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(peer)
        self.peers.clear()
        self.agent = None  # type: ignore[assignment]
