"""Token access to the dashboard: required beyond loopback, on by choice (--token) anywhere.

A request gets in with the token as
  - `?token=T` in the URL (what `megascope dashboard` prints): answered with a redirect to the same
    URL without it and an HttpOnly cookie, so the page's own requests carry the token from then on;
  - the cookie `megascope_token` set that way;
  - `Authorization: Bearer T`, or HTTP basic auth with any user name and T as the password (a
    browser opened without the token asks for it; `curl -u any:T URL` works).
Anything else is answered 401 before it reaches Dash. Tokens are compared in constant time. The
connection is plain HTTP: across networks you do not trust, put a TLS proxy or an SSH tunnel in front.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets
from http.cookies import SimpleCookie
from typing import Any, Callable, Iterable
from urllib.parse import parse_qsl, urlencode

from megascope.analyzer.bind_address import is_loopback

COOKIE = "megascope_token"
ENV_VAR = "MEGASCOPE_DASHBOARD_TOKEN"

WSGIApp = Callable[[dict[str, Any], Callable], Iterable[bytes]]


def new_token() -> str:
    """192 random bits, URL-safe."""
    return secrets.token_urlsafe(24)


def choose_token(host: str, given: str | None) -> tuple[str | None, bool]:
    """(token, generated): the given one (flag or environment) wherever bound; a fresh one for a host
    beyond loopback when none is given; None (no auth) only on loopback without one."""
    if given:
        return given, False
    if is_loopback(host):
        return None, False
    return new_token(), True


class TokenAuth:
    """WSGI middleware in front of the Dash (Flask) app; see the module docstring."""

    def __init__(self, app: WSGIApp, token: str) -> None:
        if not token:
            raise ValueError("an empty token would let everyone in")
        self.app = app
        self._token = token.encode()

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        query = parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        from_query = [v for k, v in query if k == "token"]
        if from_query and self._matches(from_query[-1]):
            return self._set_cookie_and_redirect(environ, query, start_response)
        if any(self._matches(t) for t in self._presented(environ)):
            return self.app(environ, start_response)
        start_response("401 Unauthorized", [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("WWW-Authenticate", 'Basic realm="megascope dashboard", charset="UTF-8"'),
            ("Cache-Control", "no-store")])
        return [b"megascope dashboard: a token is needed. Open the URL the dashboard printed at start "
                b"(it ends in ?token=...), or log in with any user name and the token as password.\n"]

    def _matches(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode(), self._token)

    @staticmethod
    def _presented(environ: dict[str, Any]) -> list[str]:
        """Tokens in the cookie and the Authorization header."""
        found = []
        cookie = SimpleCookie()
        try:
            cookie.load(environ.get("HTTP_COOKIE", ""))
        except Exception:  # a malformed Cookie header is no token, not a server error
            cookie = SimpleCookie()
        if COOKIE in cookie:
            found.append(cookie[COOKIE].value)
        scheme, _, value = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "bearer":
            found.append(value.strip())
        elif scheme.lower() == "basic":
            try:
                found.append(base64.b64decode(value.strip(), validate=True).decode().partition(":")[2])
            except (binascii.Error, UnicodeDecodeError):
                pass
        return found

    def _set_cookie_and_redirect(self, environ: dict[str, Any], query: list[tuple[str, str]],
                                 start_response: Callable) -> Iterable[bytes]:
        rest = urlencode([(k, v) for k, v in query if k != "token"])
        path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "/")
        # one leading slash: "//host/..." would send the browser to another site
        location = "/" + path.lstrip("/") + (f"?{rest}" if rest else "")
        start_response("303 See Other", [
            ("Location", location),
            ("Set-Cookie", f"{COOKIE}={self._token.decode()}; HttpOnly; SameSite=Strict; Path=/"),
            ("Cache-Control", "no-store"), ("Content-Length", "0")])
        return [b""]
