"""The emulated hosts themselves (``testbed.hosts``): what makes each one another machine to a process, the
link's shaping, cutting and counting, and that nothing the rig made outlives it, even when its owner is
killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from testbed.hosts import Hosts, leftover_namespaces

ROOT = Path(__file__).resolve().parents[2]

SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.bind(("0.0.0.0", 5001)); s.listen(); print("listening", flush=True)
    c, _ = s.accept(); n = 0
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        n += len(d)
    print(n, flush=True)
    """
)
CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.create_connection((sys.argv[1], 5001), timeout=30); block = b"x" * (1 << 20); t = time.monotonic()
    for _ in range(int(sys.argv[2])):
        s.sendall(block)
    s.shutdown(socket.SHUT_WR); s.recv(1); print(time.monotonic() - t, flush=True)
    """
)


def _send(hosts: Hosts, src: str, dst: str, mib: int) -> tuple[float, int]:
    """Seconds to send ``mib`` MiB over TCP from ``src`` to ``dst``, and the bytes the server counted."""
    server = hosts.run(dst, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdout.readline().strip() == b"listening"
    client = hosts.run(
        src, [sys.executable, "-c", CLIENT, hosts.name_of(dst), str(mib)], stdout=subprocess.PIPE
    )
    out, _ = client.communicate(timeout=120)
    received, _ = server.communicate(timeout=30)
    assert client.returncode == 0, out
    return float(out), int(received)


def test_each_host_has_its_own_hostname_dev_shm_and_pids_and_resolves_the_others_by_name():
    with Hosts(["a", "b", "c"], hostnames={"a": "node", "b": "node", "c": "other"}) as hosts:
        for name in "abc":
            hosts.exec(name, ["sh", "-c", f"echo {name} > /dev/shm/which"])
        for name in "abc":
            assert hosts.exec(name, ["cat", "/dev/shm/which"]).strip() == name  # private /dev/shm
        assert [hosts.exec(n, ["hostname"]).strip() for n in "abc"] == ["node", "node", "other"]
        pids = [hosts.exec(n, ["sh", "-c", "echo $$"]).strip() for n in "abc"]
        assert len(set(pids)) == 1, pids  # separate PID namespaces hand out the same pids
        assert hosts.run("a", ["true"], next_pid=777).wait(10) == 0
        assert (
            hosts.exec("b", ["sh", "-c", "echo 776 > /proc/sys/kernel/ns_last_pid; sh -c 'echo $$'"]).strip()
            == "777"
        )
        resolved = hosts.exec(
            "a", [sys.executable, "-c", "import socket; print(socket.gethostbyname('other'))"]
        )
        assert resolved.strip() == hosts.address("c")
        # only the rig's own subnet: no route out of it
        routes = hosts.exec("a", ["ip", "-4", "route"])
        assert "default" not in routes and hosts.address("a") in routes


def test_a_shaped_link_runs_at_its_rate_and_counts_what_crossed_into_the_host():
    with Hosts(["a", "b"]) as hosts:
        hosts.shape("b", rate_bps=200 * 10**6)
        before = hosts.bytes_into("b")
        seconds, received = _send(hosts, "a", "b", 40)
        assert received == 40 << 20
        rate = received * 8 / seconds
        assert 0.6 * 200e6 < rate < 1.15 * 200e6, f"{rate / 1e6:.0f} Mbit/s through a 200 Mbit/s link"
        crossed = hosts.bytes_into("b") - before
        assert received <= crossed < received * 1.1, (received, crossed)  # payload plus headers
        hosts.shape("b")
        seconds, _ = _send(hosts, "a", "b", 40)
        assert 40 * 8 * 2**20 / seconds > 400e6, "unshaped again"


def test_a_lossy_link_drops_packets_and_tcp_still_delivers_every_byte():
    with Hosts(["a", "b"]) as hosts:
        hosts.shape("b", loss_pct=20)
        # paced (0.5 ms apart): a burst would also overflow the receiving CPU's backlog on a busy machine
        probe = "import socket,time\ns=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor _ in range(2000): s.sendto(b'x', (%r, 9)); time.sleep(0.0005)"
        before = hosts.bytes_into("b")
        hosts.exec("a", [sys.executable, "-c", probe % hosts.address("b")])
        arrived = (hosts.bytes_into("b") - before) / (2000 * 43)  # one byte of payload: 43-byte frames
        assert 0.7 < arrived < 0.9, f"{arrived:.2f} of the datagrams arrived through a 20% lossy link"
        hosts.shape("b", loss_pct=5)  # TCP through 20% loss each way backs off for minutes
        _, received = _send(hosts, "a", "b", 4)
        assert received == 4 << 20


def test_a_cut_link_passes_nothing_until_it_is_restored():
    with Hosts(["a", "b"]) as hosts:
        check = "import socket,sys\ntry:\n socket.create_connection((sys.argv[1], 22), timeout=1.5)\nexcept ConnectionRefusedError:\n print('reached')\nexcept OSError as e:\n print('silence', type(e).__name__)"
        reach = lambda: hosts.exec("a", [sys.executable, "-c", check, hosts.address("b")]).strip()  # noqa: E731
        assert reach() == "reached"  # b answers (nothing listens: refused)
        hosts.cut("b")
        assert reach().startswith("silence")
        hosts.restore("b")
        assert reach() == "reached"


def test_killing_a_host_kills_every_process_on_it_and_leaves_the_others():
    with Hosts(["a", "b"]) as hosts:
        on_a = [hosts.run("a", ["sleep", "60"]) for _ in range(2)]
        on_b = hosts.run("b", ["sleep", "60"])
        hosts.kill("a")
        for proc in on_a:
            assert proc.wait(10) != 0
        assert on_b.poll() is None
        hosts.revive("a")
        assert hosts.exec("a", ["hostname"]).strip() == "host-a"


def test_nothing_outlives_the_rig_not_even_when_its_owner_is_killed(tmp_path: Path):
    with Hosts(["a"]) as hosts:
        mine = {h.namespace for h in hosts.hosts.values()} | {hosts.hub}
        assert mine <= set(leftover_namespaces())
    assert not mine & set(leftover_namespaces())
    assert not [p for p in Path("/etc/netns").glob(f"{hosts.prefix}-*")]
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom testbed.hosts import Hosts\nh = Hosts(['a', 'b']).__enter__()\nh.run('a', ['sleep', '300'])\nprint(h.prefix, flush=True)\ntime.sleep(300)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert owner.stdout is not None
    prefix = owner.stdout.readline().decode().strip()
    assert [ns for ns in leftover_namespaces() if ns.startswith(prefix + "-")]
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    deadline = time.monotonic() + 20
    while [ns for ns in leftover_namespaces() if ns.startswith(prefix + "-")] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [ns for ns in leftover_namespaces() if ns.startswith(prefix + "-")]
    assert not list(Path("/etc/netns").glob(f"{prefix}-*"))
