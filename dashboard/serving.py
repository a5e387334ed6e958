"""Serve a Dash app on a background thread (tests, screenshots): 127.0.0.1 and a free port."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import dash
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server


@dataclass
class BackgroundServer:
    server: BaseWSGIServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=10)


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args, **kwargs) -> None:  # one line per request drowns test output
        pass


def serve_in_thread(app: dash.Dash, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    """Start app on host:port (0 picks a free port) in a daemon thread; stop() ends it."""
    server = make_server(host, port, app.server, threaded=True, request_handler=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="megascope-dashboard", daemon=True)
    thread.start()
    return BackgroundServer(server, thread)
