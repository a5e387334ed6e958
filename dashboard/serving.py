"""Serving a Dash app for `megascope dashboard`: `production_server` (waitress), and `port_problem`,
the check that the address can be bound, made before the slow Dash import. (The tests' background
server is tests/browser.py.)"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Dash's import is slow: port_problem runs before it
    import dash


def port_problem(host: str, port: int) -> str | None:
    """None when host:port can be listened on now, else one line saying why and what to do."""
    if not 1 <= port <= 65535:
        return f"--port {port} is not a TCP port; use 1-65535 (default 8050)"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return f"--host {host}: not an address of this machine ({exc.strerror}); use 127.0.0.1 or one of its IPs"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"port {port} on {host} is busy (another dashboard?); "
                        f"pass another --port, e.g. --port {port + 1}")
            if exc.errno == errno.EACCES:
                return f"port {port} needs privileges on this machine; pass a --port above 1023"
            return f"cannot listen on {host}:{port} ({exc.strerror}); pass another --host or --port"
    return None


def production_server(app: dash.Dash, host: str, port: int, threads: int = 8):
    """A waitress server bound to host:port (OSError if it cannot bind); .run() serves until Ctrl-C."""
    from waitress import create_server

    return create_server(app.server, host=host, port=port, threads=threads, ident="megascope")
