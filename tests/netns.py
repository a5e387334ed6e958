"""Test hosts as Linux network namespaces: a small cluster on one machine, for multi-node tests.

    from tests import netns

    reason = netns.unavailable()          # None, or why this machine cannot make namespaces
    if reason:
        pytest.skip(reason)
    with netns.Cluster(2) as cluster:     # hosts "node0", "node1" at 10.231.0.1, 10.231.0.2
        node0, node1 = cluster.hosts
        server = node0.popen(["python", "-m", "http.server", "--bind", node0.address, "8000"])
        node1.run(["curl", f"http://{node0.address}:8000/"], timeout=10)
        node1.limit("1mbit")              # tc tbf on node1's link, both directions
        node1.unlimit()
        node1.cut(); node1.uncut()        # node1's link down at the switch (a pulled cable), then up
        node1.kill_all()                  # SIGKILL to every process in node1's namespace
    # every namespace, link and temporary file is gone here, also after an exception

Topology. Each host is a network namespace with one veth link, `eth0`, holding `host.address` (10.231.0.N/24,
N = index + 1) and `lo`. The other end of every link sits in one more namespace, the switch, on a
bridge. Nothing is created in the root namespace: the test's traffic only ever goes to addresses
inside namespaces the test made, and the subnet cannot collide with a real network (two clusters
at once do not see each other either: each has its own switch).

Identity. A command run in a host (`run`, `popen`, `argv`) runs under `ip netns exec` and `unshare
--uts --mount`: its hostname is `host.name` and /etc/hosts is the cluster's hosts file (bind-mounted in
that private mount namespace only), which maps every host's name to its address, so name resolution
and socket.gethostname() behave as on separate machines. The file system is otherwise shared (a run
directory under /tmp is "shared storage"). `host.env()` adds GLOO_SOCKET_IFNAME=eth0 to an environment.

Cleanup. `Cluster.close()` (the context manager's exit, and an atexit hook for a process that exits
without it) kills every process left in the hosts, then deletes the namespaces (which deletes the
links, the bridge and the tc qdiscs with them) and the temporary folder. Names carry the creating pid
(`msn<pid>-...`), so `remove_stale()` can remove what a SIGKILLed test left behind.

Needs root, iproute2 (`ip netns`), `unshare` and `mount` (util-linux) and, for `limit`, `tc` with the
tbf qdisc. `unavailable()` tries it once (creates and deletes a namespace) and says why not.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

PREFIX = "msn"
"""Namespace names: msn<pid>-<cluster>-<host>; the pid tells remove_stale whose they are."""
SUBNET = "10.231.0"
"""Host N (index N - 1) is 10.231.0.N/24; the subnet exists only inside a cluster's namespaces."""
IFACE = "eth0"
"""The host's end of its link, inside the host's namespace."""

_live: list["Cluster"] = []
_counter = 0
_unavailable: list[str | None] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """None when this process can build clusters; else one line saying why not (for pytest.skip)."""
    if _unavailable:
        return _unavailable[0]
    reason: str | None = None
    missing = [t for t in ("ip", "unshare", "mount", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0:
        reason = "network namespaces need root (ip netns)"
    elif missing:
        reason = f"network namespace tests need {', '.join(missing)} (iproute2, util-linux)"
    else:
        name = f"{PREFIX}{os.getpid()}-probe"
        try:
            made = _ip("netns", "add", name, check=False)
            if made.returncode:
                reason = f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
            else:
                probe = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "--mount", "true"],
                                       capture_output=True, text=True, timeout=30)
                if probe.returncode:
                    reason = f"cannot unshare uts/mount namespaces: {probe.stderr.strip()}"
        finally:
            _ip("netns", "del", name, check=False)
    _unavailable.append(reason)
    return reason


def remove_stale() -> list[str]:
    """Delete namespaces this module made in processes that no longer exist; returns their names."""
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for name in (line.split()[0] for line in listing.splitlines() if line.strip()):
        m = re.fullmatch(rf"{PREFIX}(\d+)-.*", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_namespace(name)
            removed.append(name)
    return removed


def _kill_namespace(ns: str, sig: int = signal.SIGKILL) -> None:
    for pid in _ns_pids(ns):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    _ip("netns", "del", ns, check=False)


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


class Host:
    """One test host: a network namespace with an address, a hostname and its own /etc/hosts view."""

    def __init__(self, cluster: "Cluster", index: int, name: str) -> None:
        self.cluster = cluster
        self.index = index
        self.name = name
        """Its hostname (socket.gethostname() inside it) and its name in every host's /etc/hosts."""
        self.netns = f"{cluster.tag}-h{index}"
        """The network namespace (`ip netns exec NETNS ...`)."""
        self.address = f"{SUBNET}.{index + 1}"
        """Its IPv4 address on eth0, reachable from every other host of the cluster."""
        self.switch_port = f"p{index}"
        """The other end of its link, on the bridge in the switch namespace."""

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run in this host (its network, hostname and /etc/hosts)."""
        setup = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", setup, "sh", self.name, str(self.cluster.hosts_file), *argv]

    def env(self, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        """An environment for a process of this host: `base` (default os.environ) with
        GLOO_SOCKET_IFNAME=eth0 (gloo binds to the host's link) and `extra`."""
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = IFACE
        env.update(extra)
        return env

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `argv` in this host (subprocess.Popen keyword arguments pass through)."""
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run `argv` in this host to completion (subprocess.run: capture_output, check, ... pass through)."""
        return subprocess.run(self.argv(argv), timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        """Every process in this host's network namespace now."""
        return _ns_pids(self.netns)

    def kill_all(self, sig: int = signal.SIGKILL, wait_s: float = 10) -> list[int]:
        """Send `sig` to every process of this host (the host "dies"); with SIGKILL wait until they are
        gone (at most wait_s). Returns the pids signalled."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while sig == signal.SIGKILL and self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def limit(self, rate: str, burst: str = "32kb", latency: str = "100ms") -> None:
        """Rate-limit this host's link in both directions with a token bucket (tc tbf): `rate`,
        `burst` and `latency` in tc's units ("10mbit", "32kb", "100ms"). Replaces an earlier limit."""
        for ns, dev in ((self.netns, IFACE), (self.cluster.switch, self.switch_port)):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", latency], check=True, capture_output=True, text=True)

    def unlimit(self) -> None:
        """Remove the rate limit (no error when there is none)."""
        for ns, dev in ((self.netns, IFACE), (self.cluster.switch, self.switch_port)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def cut(self) -> None:
        """Cut this host's link: its port on the switch goes down (`ip link set pN down`), as a cable
        pulled at the switch. The host keeps its address and routes (its eth0 only loses carrier), so
        TCP connections retransmit and ride out a short cut instead of failing at once."""
        _ip("-n", self.cluster.switch, "link", "set", self.switch_port, "down")

    def uncut(self) -> None:
        """Restore the link after `cut` (no error when it is up)."""
        _ip("-n", self.cluster.switch, "link", "set", self.switch_port, "up", check=False)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns={self.netns!r})"


class Cluster:
    """`n` hosts on one bridge. Use as a context manager; `close()` is idempotent."""

    def __init__(self, n: int, names: Sequence[str] | None = None) -> None:
        global _counter
        if not 1 <= n <= 250:
            raise ValueError(f"a cluster has 1..250 hosts, not {n}")
        names = list(names) if names is not None else [f"node{i}" for i in range(n)]
        if len(names) != n or len(set(names)) != n:
            raise ValueError(f"need {n} distinct host names, got {names}")
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        _counter += 1
        self.tag = f"{PREFIX}{os.getpid()}-{_counter}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(self, i, name) for i, name in enumerate(names)]
        self._tmp = Path(tempfile.mkdtemp(prefix="megascope-netns-"))
        self.hosts_file = self._tmp / "hosts"
        self._closed = False
        _live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{h.address} {h.name}" for h in self.hosts]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("-n", self.switch, "link", "add", h.switch_port, "type", "veth", "peer", "name", IFACE,
                "netns", h.netns)
            _ip("-n", self.switch, "link", "set", h.switch_port, "master", "br0")
            _ip("-n", self.switch, "link", "set", h.switch_port, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", IFACE)
            _ip("-n", h.netns, "link", "set", IFACE, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def close(self) -> None:
        """Kill what still runs in the hosts, delete every namespace (links, bridge, qdiscs go with
        them) and the temporary folder. Safe to call twice and after a failed build."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            _kill_namespace(h.netns)
        _ip("netns", "del", self.switch, check=False)
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for cluster in list(_live):
        cluster.close()
