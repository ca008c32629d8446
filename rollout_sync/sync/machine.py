"""Which processes share a machine, from evidence two machines cannot share.

Same-host transports (shared memory segments in ``/dev/shm``, pulls with ``process_vm_readv`` by pid, CUDA
IPC handles, in-process copies) work only between processes that really share a kernel, a ``/dev/shm`` and
a PID namespace. Hostnames prove none of that: two containers on two machines often share a hostname, and
two PID namespaces hand out the same pids. So every process reports a **machine key** in its hello:

- the kernel's boot id (``/proc/sys/kernel/random/boot_id``): random per boot, so two machines differ;
- a token kept in the shared-memory directory: the first process to look writes a random token there and
  every later one reads that token back, so two processes report the same token only if they see the same
  ``/dev/shm`` (two containers on one kernel with private ``/dev/shm`` each made their own);
- the PID namespace (``/proc/self/ns/pid``): pids mean the same thing only inside one.

Two ranks are on one machine (for the transports) exactly when their keys are equal. A process that cannot
read one of these facts reports a key of its own (no peer shares it): it is never taken for a neighbour.

The **network key** (boot id and network namespace) says whether two processes share a loopback interface:
an address on ``127.0.0.0/8`` means the same thing to both only then (empty where unknown: not compared).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import secrets
from pathlib import Path

__all__ = ["TOKEN_NAME", "machine_key", "network_key", "shm_token"]

TOKEN_NAME = "rollout-sync-machine"
"""The token file's name in the shared-memory directory (not a segment: no pid in its name)."""


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def _namespace(kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return None


def shm_token(directory: Path) -> str | None:
    """The token of the shared-memory directory ``directory``: read back, or written first (atomically:
    a link to a complete file, so that a racing process reads the winner's token). None when it can be
    neither read nor written."""
    path = directory / TOKEN_NAME
    token = _read(str(path))
    if token is not None:
        return token
    tmp = directory / f".{TOKEN_NAME}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.write_text(secrets.token_hex(16))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return _read(str(path))


def _key(*facts: str | None) -> str:
    if any(f is None for f in facts):
        return "unique-" + secrets.token_hex(8)  # a fact is missing: share nothing with anyone
    return hashlib.sha256("\0".join(f for f in facts if f is not None).encode()).hexdigest()[:20]


@functools.cache
def machine_key() -> str:
    """This process's machine key (see the module doc); the same for every process that shares its kernel,
    its ``/dev/shm`` and its PID namespace."""
    from ..transport.same_host.shared_memory import shm_dir

    return _key(_read("/proc/sys/kernel/random/boot_id"), shm_token(shm_dir()), _namespace("pid"))


@functools.cache
def network_key() -> str:
    """The same for every process that shares this one's kernel and network namespace (its loopback);
    empty where unknown."""
    boot, net = _read("/proc/sys/kernel/random/boot_id"), _namespace("net")
    return _key(boot, net) if boot and net else ""
