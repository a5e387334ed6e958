"""Whether a server's bind address stays on this machine: the one rule the dashboard (dashboard/auth.py,
dashboard/cli.py) and the live watcher's control server (watch/cli.py) apply before they listen; beyond
loopback each of them needs a token."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1; anything else (0.0.0.0 included) reaches beyond this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
