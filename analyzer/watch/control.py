"""The watcher's HTTP port (`megascope watch --metrics-port PORT`): its metrics, its status, and its
settings read and changed while it runs.

    GET  /metrics    Prometheus text (once the run's run.json was read; 503 before)
    GET  /status     what it follows and how far behind the run it is (JSON)
    GET  /settings   window, webhook and every detector threshold (JSON)
    POST /settings   {"window": 48, "webhook": "http://127.0.0.1:9000/hook" or null,
                      "set": {"detect.straggler.min_ratio": 1.05}}    any of the three; all or nothing

Bound to 127.0.0.1 by default. Bound to any other address it needs a token (`--token-file`), which
every request must send as `Authorization: Bearer TOKEN` (a loopback bind given a token checks it
too): the settings decide what pages people. A bad request is answered 4xx with one JSON line
`{"error": "..."}` saying what is wrong, and changes nothing.
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from megascope.analyzer.watch.reconfigure import change, settings_of, status_of

MAX_BODY = 64 * 1024
"""A settings change is a few hundred bytes; anything past this is refused unread."""

StartResponse = Callable[..., Any]


class RequestError(ValueError):
    """A request that cannot be served as asked; `status` is the HTTP answer, the message its one line."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class ControlApp:
    """WSGI app over a watcher (watch/reconfigure.py reads and changes it)."""

    def __init__(self, watcher: Any, token: str | None = None) -> None:
        self.watcher, self.token = watcher, token

    def __call__(self, environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        try:
            self._authorize(environ)
            method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/").rstrip("/") or "/"
            if path == "/metrics":
                return self._metrics(environ, start_response)
            if path == "/status" and method == "GET":
                return _json(start_response, "200 OK", status_of(self.watcher))
            if path == "/settings" and method == "GET":
                return _json(start_response, "200 OK", settings_of(self.watcher))
            if path == "/settings" and method in ("POST", "PUT", "PATCH"):
                return _json(start_response, "200 OK", change(self.watcher, _body(environ)))
            if path in ("/status", "/settings"):
                raise RequestError("405 Method Not Allowed", f"{method} {path}: use GET (or POST on /settings)")
            raise RequestError("404 Not Found", f"no {path}: the watcher serves /metrics, /status and /settings")
        except RequestError as exc:
            return _json(start_response, exc.status, {"error": str(exc)})
        except ValueError as exc:  # a setting it cannot take (SettingsError), a bad window or webhook
            return _json(start_response, "400 Bad Request", {"error": str(exc)})
        except Exception as exc:  # a bug here must not take the port down or print a traceback
            self.watcher.log(f"HTTP {environ.get('PATH_INFO')} failed ({type(exc).__name__}: {exc})")
            return _json(start_response, "500 Internal Server Error", {"error": f"{type(exc).__name__}: {exc}"})

    def _authorize(self, environ: dict) -> None:
        if self.token is None:
            return
        sent = environ.get("HTTP_AUTHORIZATION", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            raise RequestError("401 Unauthorized", "send the watcher's token: Authorization: Bearer TOKEN")

    def _metrics(self, environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        metrics = self.watcher.metrics
        if metrics is None:
            raise RequestError("503 Service Unavailable", "no metrics yet: the run's run.json was not read yet")
        return make_wsgi_app(metrics.registry)(environ, start_response)


def _body(environ: dict) -> dict:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise RequestError("400 Bad Request", "Content-Length is not a number") from None
    if length > MAX_BODY:
        raise RequestError("413 Payload Too Large", f"a settings change is at most {MAX_BODY} bytes")
    try:
        body = json.loads(environ["wsgi.input"].read(length) or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise RequestError("400 Bad Request", 'the body is not JSON; send e.g. {"window": 48}') from None
    if not isinstance(body, dict):
        raise RequestError("400 Bad Request", 'the body must be a JSON object, e.g. {"window": 48}')
    return body


def _json(start_response: StartResponse, status: str, payload: dict) -> list[bytes]:
    data = (json.dumps(payload, allow_nan=False, default=str) + "\n").encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow client never keeps the watcher from exiting


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass  # Prometheus scrapes every few seconds: no line per request on stderr


def serve(app: ControlApp, addr: str, port: int) -> WSGIServer:
    """Serve `app` on addr:port from a daemon thread; returns the server (.server_port, .shutdown())."""
    server = make_server(addr, port, app, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="megascope-watch-http", daemon=True).start()
    return server
