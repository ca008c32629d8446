"""Emulated hosts on one machine, for tests and benchmarks that cross a host boundary (needs root).

Each host is what another machine looks like to a process:

- its own **network namespace**, with one interface ``eth0`` (an address on a private subnet that exists
  only inside the rig's namespaces, never routed outside) and its own loopback;
- its own **hostname** (UTS namespace), a private **``/dev/shm``** (a tmpfs in its own mount namespace) and
  its own **PID namespace** (its first process is pid 1, so two hosts hand out the same pids);
- names resolve through ``/etc/netns/NS/hosts`` (``ip netns exec`` binds it over ``/etc/hosts``), as DNS
  would on a cluster: every host's hostname to its address.

The hosts' ``eth0`` are veth links to a bridge in a hub namespace (a switch). Each link can be shaped with
``tc`` (rate and random loss, both directions), cut (its switch port taken off the bridge: the host's own
interface stays up, as when a cable further along is pulled) and restored; ``bytes_into(host)`` counts
what crossed the link into it.

A host lives as long as its holder: a process at pid 1 of the host's PID namespace, inside all its
namespaces. ``run`` starts a command there (``nsenter``); ``kill`` SIGKILLs every process of the host (its
PID namespace's init dies, and the kernel kills the rest).

Cleanup: ``close`` (and leaving the ``with`` block) removes every namespace, link, process and
``/etc/netns`` entry the rig made, also after a failed test. A rig whose owner is killed outright (SIGKILL
of pytest) is removed by a reaper process the rig starts, which waits for its owner to go; and every new rig
first removes what rigs of dead owners left. All names start with ``rsh<owner pid>x<serial>-``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Host", "Hosts", "available", "leftover_namespaces"]

PREFIX = "rsh"
SUBNET = ipaddress.ip_network("10.231.0.0/24")
_NS = re.compile(rf"^{PREFIX}(\d+)x\d+-")
_serial = itertools.count(1)
_DROP = "drop0"  # a device that is never up: packets redirected to it are dropped

# Removes every namespace named $1-* (its processes first), its /etc/netns entry, and the rig's files.
_CLEANUP = r"""
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$1-"); do
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  ip netns del "$ns" 2>/dev/null
  rm -rf "/etc/netns/$ns"
done
rm -f /run/"$1"-*
"""
# Waits for the owner ($2) to exit, then cleans up after it.
_REAPER = 'while kill -0 "$2" 2>/dev/null; do sleep 0.5; done;' + _CLEANUP

# The holder: names the host, gives it a private /dev/shm, says ready and stays as pid 1 of the host.
_HOLD = 'hostname "$1" && mount -t tmpfs -o size="$2" tmpfs /dev/shm && echo ready && exec sleep infinity'


def available() -> str | None:
    """Why the rig cannot run here (None: it can): it needs root and ``ip``, ``tc``, ``nsenter``,
    ``unshare``."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network, mount and PID namespaces)"
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
    return f"emulated hosts need {', '.join(missing)}" if missing else None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_namespaces() -> list[str]:
    """Network namespaces of rigs (this process's included) that still exist."""
    listed = _sh("ip", "netns", "list", check=False).stdout.split("\n")
    return sorted(line.split()[0] for line in listed if line.strip() and _NS.match(line.split()[0]))


def _sweep_dead_owners() -> None:
    prefixes = {m.group(0)[:-1] for ns in leftover_namespaces() if (m := _NS.match(ns))}
    for prefix in prefixes:
        owner = _NS.match(prefix + "-")
        if owner is not None and not _alive(int(owner.group(1))):
            subprocess.run(["sh", "-c", _CLEANUP, "sh", prefix], capture_output=True, timeout=60)


@dataclass
class Host:
    name: str  # the rig's name for it ("a")
    hostname: str  # what ``hostname`` says on it
    namespace: str  # its network namespace
    address: str  # its eth0 address
    port: str  # its switch port (the veth end in the hub namespace)
    holder: subprocess.Popen[bytes] | None = None
    init_pid: int = 0  # pid 1 of the host's PID namespace, as this process sees it


def _pid_inside(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> int | None:
    """The pid, inside its host, of the process ``nsenter`` (``proc``) forked into the host's PID namespace;
    None when it did not appear (or exited) within ``timeout``."""
    deadline = time.monotonic() + timeout
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            child = children.read_text().split()
            if child:
                status = Path(f"/proc/{child[0]}/status").read_text()
                return int(next(line for line in status.splitlines() if line.startswith("NSpid:")).split()[-1])
        time.sleep(0.001)
    return None


class Hosts:
    """Emulated hosts ``names`` (short lower-case words), each with hostname ``hostnames[name]`` (default:
    ``host-<name>``; two hosts may share one). ``shm_size``: each host's ``/dev/shm``.

        with Hosts(["a", "b"]) as hosts:
            proc = hosts.run("b", [sys.executable, "program.py", "--address", f"tcp://{hosts.name_of('a')}:29700"])
            hosts.shape("b", rate_bps=10**9, loss_pct=5)
    """

    def __init__(
        self,
        names: Sequence[str] = ("a", "b"),
        *,
        hostnames: Mapping[str, str] | None = None,
        shm_size: str = "4g",
    ) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        for name in names:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name):
                raise ValueError(f"host name {name!r}: use 1-8 lower-case letters and digits")
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and not empty: {list(names)}")
        self.prefix = f"{PREFIX}{os.getpid()}x{next(_serial)}"
        self.hub = f"{self.prefix}-hub"
        hostnames = dict(hostnames or {})
        addresses = list(itertools.islice(SUBNET.hosts(), len(names)))
        self.hosts = {
            name: Host(
                name,
                hostnames.get(name, f"host-{name}"),
                f"{self.prefix}-{name}",
                str(addresses[i]),
                f"p-{name}",
            )
            for i, name in enumerate(names)
        }
        self.shm_size = shm_size
        self.reaper: subprocess.Popen[bytes] | None = None
        self.processes: list[subprocess.Popen[Any]] = []
        self.files: list[Path] = []
        self.closed = False

    # -- life ----------------------------------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        _sweep_dead_owners()
        # the reaper first: from here on nothing the rig makes outlives its owner
        self.reaper = subprocess.Popen(
            ["sh", "-c", _REAPER, "sh", self.prefix, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _sh("ip", "netns", "add", self.hub)
        _sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.hostname}\n" for h in self.hosts.values()
        )
        for h in self.hosts.values():
            _sh("ip", "netns", "add", h.namespace)
            etc = Path("/etc/netns") / h.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            _sh("ip", "link", "add", "name", "eth0", "netns", h.namespace, "type", "veth", "peer", "name", h.port, "netns", self.hub)  # fmt: skip
            _sh("ip", "-n", self.hub, "link", "set", h.port, "master", "br0", "up")
            _sh("ip", "-n", h.namespace, "addr", "add", f"{h.address}/{SUBNET.prefixlen}", "dev", "eth0")
            _sh("ip", "-n", h.namespace, "link", "set", "eth0", "up")
            _sh("ip", "-n", h.namespace, "link", "set", "lo", "up")
        for h in self.hosts.values():
            self._hold(h)

    def _hold(self, h: Host) -> None:
        holder = subprocess.Popen(
            ["ip", "netns", "exec", h.namespace, "unshare", "--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private", "sh", "-c", _HOLD, "sh", h.hostname, self.shm_size],  # fmt: skip
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], 30)
        line = holder.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            holder.kill()
            err = holder.stderr.read().decode(errors="replace") if holder.stderr else ""
            raise RuntimeError(f"host {h.name} did not start: {line!r} {err}")
        children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
        h.holder, h.init_pid = holder, int(children[0])

    def close(self) -> None:
        """Stop every process of every host and remove everything the rig made (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for proc in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["sh", "-c", _CLEANUP, "sh", self.prefix], capture_output=True, timeout=120)
        for path in self.files:
            path.unlink(missing_ok=True)
        for proc in [*self.processes, *(h.holder for h in self.hosts.values() if h.holder)]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait(10)

    # -- processes -----------------------------------------------------------------------------------------
    def run(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
        next_pid: int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (in its own session: ``stop`` kills it and what it started).
        ``next_pid``: the pid it gets inside the host (the host's next free pid is set first), to make two
        hosts' processes share pids."""
        h = self.hosts[host]
        cmd = ["nsenter", "-t", str(h.init_pid), "-n", "-u", "-m", "-p", f"--wd={os.fspath(cwd or os.getcwd())}"]
        for _ in range(20):
            if next_pid is not None:
                self.exec(host, ["sh", "-c", f"echo {next_pid - 1} > /proc/sys/kernel/ns_last_pid"])
            proc = subprocess.Popen(
                [*cmd, "--", *argv],
                env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
            self.processes.append(proc)
            if next_pid is None or _pid_inside(proc) == next_pid:
                return proc
            # A thread of another process of the host took that pid first (threads draw from the same
            # numbers): start it again.
            self.stop(proc)
        raise RuntimeError(f"host {host}: could not start {argv[0]} as pid {next_pid} in 20 tries")

    def python_launcher(self, host: str, python: str | None = None) -> str:
        """An executable file that runs ``python`` (this interpreter by default) with its arguments on
        ``host``: what ``multiprocessing``'s spawn needs to start a process there (``RankPool(launcher=)``;
        the pipes it passes survive ``nsenter``). Removed with the rig."""
        h = self.hosts[host]
        path = Path(f"/run/{self.prefix}-{host}-python")
        enter = f"nsenter -t {h.init_pid} -n -u -m -p --wd=\"$PWD\""
        path.write_text(f'#!/bin/sh\nexec {enter} -- {python or sys.executable} "$@"\n')
        path.chmod(0o755)
        self.files.append(path)
        return str(path)

    def exec(
        self, host: str, argv: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None
    ) -> str:
        """Run ``argv`` on ``host`` to completion (``env``: its environment, else this one); its standard
        output (raises when it fails)."""
        h = self.hosts[host]
        cmd = ["nsenter", "-t", str(h.init_pid), "-n", "-u", "-m", "-p", "--", *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on host {host} failed ({done.returncode}): {done.stderr}")
        return done.stdout

    @staticmethod
    def stop(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
        """Kill ``proc`` and everything in its session, if it still runs."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)

    def kill(self, host: str) -> None:
        """SIGKILL every process of ``host`` at once (its PID namespace's init; the kernel kills the rest).
        The host's network stays; it runs nothing until ``revive``."""
        h = self.hosts[host]
        with contextlib.suppress(ProcessLookupError):
            os.kill(h.init_pid, signal.SIGKILL)
        if h.holder is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.holder.wait(10)

    def revive(self, host: str) -> None:
        """A killed host boots again: new PID namespace, empty ``/dev/shm``, same name and address."""
        self._hold(self.hosts[host])

    # -- names ---------------------------------------------------------------------------------------------
    def address(self, host: str) -> str:
        return self.hosts[host].address

    def name_of(self, host: str) -> str:
        """The hostname other hosts resolve to ``host``'s address (unique hostnames only)."""
        h = self.hosts[host]
        if sum(o.hostname == h.hostname for o in self.hosts.values()) > 1:
            return h.address  # a shared hostname resolves to the first such host: use the address
        return h.hostname

    # -- the links -----------------------------------------------------------------------------------------
    def shape(
        self, host: str, *, rate_bps: int | None = None, loss_pct: float = 0.0, burst_bytes: int | None = None
    ) -> None:
        """Shape ``host``'s link in both directions: a rate in bits/s (``tbf``) and random loss of
        ``loss_pct`` percent of packets (a classic BPF filter that draws a random number per packet and
        redirects the unlucky ones to a device that is down, which drops them: kernels without ``netem``,
        as on these machines, have these). ``burst_bytes``: what passes at once at the start (default: 256
        KiB or 4 ms of the rate; at least one GSO packet, 64 KiB and headers). No arguments: unshaped."""
        h = self.hosts[host]
        for ns, dev in ((h.namespace, "eth0"), (self.hub, h.port)):
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "clsact", check=False)
            if rate_bps:
                burst = burst_bytes or max(256 * 1024, int(rate_bps) // 8 // 250)  # a GSO packet; 4 ms
                _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms")  # fmt: skip
            if loss_pct:
                if _sh("ip", "-n", ns, "link", "show", "dev", _DROP, check=False).returncode != 0:
                    _sh("ip", "-n", ns, "link", "add", _DROP, "type", "ifb")  # stays down: a sink
                threshold = min(int(loss_pct / 100 * 2**32), 2**32 - 1)
                # ld rand; jge threshold -> keep; else -> match (redirected, dropped)
                code = f"4,32 0 0 4294963256,53 1 0 {threshold},6 0 0 4294967295,6 0 0 0"
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "clsact")
                _sh("tc", "-n", ns, "filter", "add", "dev", dev, "egress", "bpf", "bytecode", code, "action", "mirred", "egress", "redirect", "dev", _DROP)  # fmt: skip

    def cut(self, host: str) -> None:
        """Cut ``host`` off the network: its switch port leaves the bridge (no frame passes either way;
        the host's own interface stays up, so its connections only see silence)."""
        _sh("ip", "-n", self.hub, "link", "set", self.hosts[host].port, "nomaster")

    def restore(self, host: str) -> None:
        """Undo ``cut``."""
        _sh("ip", "-n", self.hub, "link", "set", self.hosts[host].port, "master", "br0")

    def bytes_into(self, host: str) -> int:
        """Bytes that crossed ``host``'s link into it so far (its switch port's transmit counter)."""
        return self._counter(host, "tx")

    def bytes_out_of(self, host: str) -> int:
        return self._counter(host, "rx")

    def _counter(self, host: str, way: str) -> int:
        out = _sh("ip", "-n", self.hub, "-j", "-s", "link", "show", "dev", self.hosts[host].port).stdout
        return int(json.loads(out)[0]["stats64"][way]["bytes"])

    def names(self) -> Iterable[str]:
        return self.hosts.keys()
