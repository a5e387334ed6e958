"""tests/netns.py itself: hosts see each other by name over their links, have their own hostname, can be
killed as a whole, rate-limited, and leave nothing behind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 5000))
print("ready", flush=True)
c, peer = s.accept()
n = 0
while (d := c.recv(65536)):
    n += len(d)
print(socket.gethostname(), peer[0], n, flush=True)
"""
CLIENT = """
import socket, sys
c = socket.create_connection(("node0", 5000), timeout=20)
c.sendall(b"x" * int(sys.argv[1]))
c.close()
print(socket.gethostname(), flush=True)
"""


def _send(cluster: netns.Cluster, size: int) -> tuple[str, str, float]:
    node0, node1 = cluster.hosts
    server = node0.popen([sys.executable, "-c", SERVER, node0.address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        client = node1.run([sys.executable, "-c", CLIENT, str(size)], capture_output=True, text=True, check=True)
        out, _ = server.communicate(timeout=30)
        return out, client.stdout, time.monotonic() - t0
    finally:
        server.kill()


def test_hosts_by_name_hostname_limit_kill_and_cleanup() -> None:
    with netns.Cluster(2) as cluster:
        node0, node1 = cluster.hosts
        out, client_out, _ = _send(cluster, 100_000)
        assert out.split() == ["node0", node1.address, "100000"]  # node1's traffic came over its link
        assert client_out.strip() == "node1"

        node1.limit("2mbit")  # 250 kB/s: 500 kB take >= 2 s; unlimited, a veth moves them in milliseconds
        _, _, slow_s = _send(cluster, 500_000)
        node1.unlimit()
        _, _, fast_s = _send(cluster, 500_000)
        assert slow_s > 1.5 > fast_s, (slow_s, fast_s)

        sleeper = node1.popen(["sleep", "300"])
        deadline = time.monotonic() + 10
        while sleeper.pid not in node1.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in node1.kill_all()
        assert sleeper.wait(timeout=10) == -9 and node1.pids() == []
        names = [node0.netns, node1.netns, cluster.switch]
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listing for name in names), listing


def test_failed_body_still_cleans_up() -> None:
    with pytest.raises(RuntimeError):
        with netns.Cluster(1) as cluster:
            cluster.hosts[0].popen(["sleep", "300"])
            raise RuntimeError("test body failed")
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cluster.tag not in listing
