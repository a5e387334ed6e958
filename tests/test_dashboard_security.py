"""Who gets into the dashboard and what a browser can make it do.

Through the real `megascope dashboard` (waitress, bound to 127.0.0.1 with auth forced on by --token): a
request without the token gets 401, one with it gets the page. Bad --port / busy port / unsafe flags
end in one line. And every callback input and URL query parameter, fed `../` paths and SQL quotes,
opens only the served runs and never reaches SQL text.
"""

from __future__ import annotations

import base64
import contextvars
import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import dash
import pytest

from megascope.analyzer.bind_address import is_loopback
from megascope.dashboard.auth import choose_token

TOKEN = "test-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascope", "dashboard", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (proc.returncode, err)
    assert "serving" not in proc.stdout
    for needle in needles:
        assert needle in err, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, simulated_run) -> tuple[Path, Path]:
    """A served run, and a run next to it that is not served (what a `../` would try to reach)."""
    root = tmp_path_factory.mktemp("security")
    served = simulated_run(root / "served", dp=2, tp=1, pp=2, steps=6)
    secret = simulated_run(root / "secret", dp=2, tp=1, pp=1, steps=4)
    return Path(served), Path(secret)


def test_port_out_of_range_is_one_line(runs):
    assert_one_line(dashboard(str(runs[0]), "--port", "99999"), "--port 99999 is not a TCP port", "1-65535")


def test_busy_port_is_checked_before_serving(runs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = dashboard(str(runs[0]), "--port", str(port))
    assert_one_line(proc, f"port {port} on 127.0.0.1 is busy", "--port")


def test_unsafe_or_weak_settings_are_refused(runs):
    assert_one_line(dashboard(str(runs[0]), "--debug", "--host", "0.0.0.0"), "--debug", "loopback only")
    assert_one_line(dashboard(str(runs[0]), "--token", "secret"), "--token must be 16 or more characters")


def test_a_token_is_generated_beyond_loopback():
    assert choose_token("127.0.0.1", None) == (None, False) and choose_token("localhost", None) == (None, False)
    assert is_loopback("::1") and is_loopback("127.0.0.2") and not is_loopback("0.0.0.0")
    for host in ("0.0.0.0", "::", "192.168.1.20", "myhost.example"):
        token, generated = choose_token(host, None)
        assert generated and token and len(token) >= 32
    assert choose_token("0.0.0.0", TOKEN) == (TOKEN, False)
    assert choose_token("127.0.0.1", TOKEN) == (TOKEN, False)  # given on loopback: still required


def _get(url: str, headers: dict[str, str] | None = None):
    """(status, headers (case-insensitive), body) without following redirects."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()


@pytest.fixture(scope="module")
def served(runs):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "dashboard", str(runs[0]), "--port", str(port),
                             "--token", TOKEN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "serving 1 run(s) at http://127.0.0.1" in line, (line, proc.poll())
    base = f"http://127.0.0.1:{port}"
    yield base, proc
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


def test_requests_without_the_token_get_401(served):
    base, _ = served
    for path in ("/", "/timeline?run=0", "/_dash-layout", "/_dash-dependencies", "/assets/style.css"):
        status, headers, body = _get(base + path)
        assert status == 401, path
        assert "<html" not in body.lower() and "token is needed" in body
        assert headers["WWW-Authenticate"].startswith("Basic")
    wrong = base64.b64encode(b"me:not-the-token-0123456789").decode()
    assert _get(base + "/", {"Authorization": f"Basic {wrong}"})[0] == 401
    assert _get(base + "/", {"Cookie": "megascope_token=not-the-token"})[0] == 401
    assert _get(base + "/?token=not-the-token-0123456789")[0] == 401


def test_requests_with_the_token_get_the_page_from_waitress(served):
    base, _ = served
    basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    for headers in ({"Authorization": f"Basic {basic}"}, {"Authorization": f"Bearer {TOKEN}"},
                    {"Cookie": f"megascope_token={TOKEN}"}):
        status, response_headers, body = _get(base + "/", headers)
        assert status == 200 and "<title>megascope</title>" in body
        assert response_headers["Server"] == "megascope"  # waitress (ident); Werkzeug says "Werkzeug/x"
    layout = _get(base + "/_dash-layout", {"Authorization": f"Bearer {TOKEN}"})
    assert layout[0] == 200 and json.loads(layout[2])


def test_the_printed_link_sets_a_cookie_and_drops_the_token_from_the_url(served):
    base, _ = served
    status, headers, _ = _get(f"{base}/timeline?run=0&token={TOKEN}")
    assert status == 303 and headers["Location"] == "/timeline?run=0"
    cookie = headers["Set-Cookie"]
    assert cookie.startswith(f"megascope_token={TOKEN};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert _get(f"{base}//evil.example/?token={TOKEN}")[1]["Location"] == "/evil.example/"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_it_cleanly(runs, inherited):
    """Also when started with SIGINT ignored (in the background by a script, `cmd &` without job
    control, or under nohup: Python then never raises KeyboardInterrupt unless the handler is set)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "dashboard", str(runs[0]), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint if inherited == "ignored" else None)
    assert "serving" in proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped" in out and "Traceback" not in err


# ---------------------------------------------------------------- nothing becomes a path or SQL

PAYLOADS = ["../secret", "../../../../etc/passwd", "/etc/passwd", "'; DROP TABLE steps; --", "1' OR '1'='1",
            "\"); SELECT * FROM read_csv('/etc/passwd'); --", "%2e%2e%2fsecret"]
QUERY_NAMES = ["run", "step", "ranks", "view", "metric", "group_by", "color", "token", "path", "sql"]


def _values(payload: str, prop: str, page_paths: list[str]) -> list:
    """What a browser could send for this property: the payload as a string, a list, a number's place,
    a click event; for the URL, every page with every query parameter set to it."""
    if prop == "search":
        return ["?" + "&".join(f"{name}={quote(payload)}" for name in QUERY_NAMES)]
    if prop == "pathname":
        return [*page_paths, "/" + payload]
    click = {"points": [{key: payload for key in ("x", "y", "z", "customdata", "text", "pointIndex")}]}
    return [payload, [payload, "1"], click, {"run": payload}]


def test_callback_inputs_and_query_parameters_never_become_paths_or_sql(runs, monkeypatch):
    from megascope.analyzer import Run
    from megascope.analyzer.data.store import Store
    from megascope.dashboard.app import create_app

    served, secret = runs
    opened: list[Path] = []
    sql: list[str] = []
    original_open = Run.open.__func__

    def spy_open(cls, path, *args, **kwargs):
        opened.append(Path(path).resolve())
        return original_open(cls, path, *args, **kwargs)

    def spy(method):
        def wrapper(self, text, params=None):
            sql.append(str(text))
            return method(self, text, params)
        return wrapper

    monkeypatch.setattr(Run, "open", classmethod(spy_open))
    for name in ("query", "execute", "arrow"):
        monkeypatch.setattr(Store, name, spy(getattr(Store, name)))

    # Dash records the app of a request in a context variable of the calling context: keep it in a
    # copy, or later tests in this process would find this app instead of their own
    contextvars.copy_context().run(_drive_every_callback, lambda: create_app([served], token=TOKEN), served,
                                   secret, opened, sql)


def _drive_every_callback(make_app, served: Path, secret: Path, opened: list[Path], sql: list[str]) -> None:
    client = make_app().server.test_client()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    dependencies = [d for d in client.get("/_dash-dependencies", headers=auth).get_json()
                    if not d.get("clientside_function")]  # those run in the browser, not here
    pages = sorted({p["relative_path"] for p in dash.page_registry.values()})
    assert len(dependencies) >= 10 and "/timeline" in pages

    server_errors, calls = [], 0
    for callback in dependencies:
        outputs = _outputs(callback["output"])
        for payload in PAYLOADS:
            for i, item in enumerate(callback["inputs"] + callback["state"]):
                for value in _values(payload, item["property"], pages):
                    body = _request_body(callback, outputs, changed=i, value=value)
                    response = client.post("/_dash-update-component", json=body, headers=auth)
                    calls += 1
                    if response.status_code >= 500:
                        server_errors.append((callback["output"], item["id"], item["property"], value))
    assert calls > 500
    assert opened and set(opened) <= {served.resolve()}, f"opened a directory that is not served: {set(opened)}"
    assert secret.resolve() not in opened
    leaked = [(p, s) for s in sql for p in PAYLOADS + [str(secret)] if p in s]
    assert not leaked, f"browser input in SQL text: {leaked[:3]}"
    assert sql, "the spy saw no SQL at all: the test would pass for the wrong reason"
    assert not server_errors, f"{len(server_errors)} inputs crashed a callback, e.g. {server_errors[:5]}"


def _outputs(output: str) -> list[dict[str, str]] | dict[str, str]:
    """The renderer's `outputs` for a callback's output string ("..a.b...c.d.." when several)."""
    def one(text: str) -> dict[str, str]:
        ident, _, prop = text.rpartition(".")
        return {"id": ident, "property": prop.split("@")[0]}

    if output.startswith(".."):
        return [one(part) for part in output[2:-2].split("...")]
    return one(output)


def _request_body(callback: dict, outputs, changed: int, value) -> dict:
    items = callback["inputs"] + callback["state"]
    filled = [{"id": it["id"], "property": it["property"], "value": value if n == changed else None}
              for n, it in enumerate(items)]
    n_inputs = len(callback["inputs"])
    trigger = items[min(changed, n_inputs - 1)]
    return {"output": callback["output"], "outputs": outputs, "inputs": filled[:n_inputs],
            "state": filled[n_inputs:], "changedPropIds": [f"{trigger['id']}.{trigger['property']}"]}
