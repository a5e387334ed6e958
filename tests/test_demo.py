"""`megascope demo` (the README's main job) end to end: 8 gloo ranks with a straggler and a flapping
link, the analysis naming both, the report and Perfetto trace, then the dashboard served on loopback
until Ctrl-C."""

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> list[str]:
    """Lines of stdout up to and including the first one containing `needle`."""
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no '{needle}' in {timeout_s} s (exit {proc.poll()}):\n" + "".join(lines[-60:]))


def test_demo_trains_names_both_faults_and_serves_the_dashboard(tmp_path):
    run, port = tmp_path / "demo", _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "demo", "--run-dir", str(run), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = _wait_for_line(proc, "megascope dashboard: serving", timeout_s=900)
        url = f"http://127.0.0.1:{port}/"
        for _ in range(100):  # the server binds just after printing its URL
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"dashboard not answering at {url}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    out = "".join(lines)
    assert "done: 30 steps" in out, out[-3000:]
    assert (run / "report.html").stat().st_size > 0
    trace = json.loads((run / "trace.perfetto.json").read_text())
    assert trace["traceEvents"]

    analysis = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(run), "--json"],
                              capture_output=True, text=True, timeout=600)
    assert analysis.returncode == 0, analysis.stderr[-3000:]
    findings = json.loads(analysis.stdout)["findings"]
    kinds = {(f["kind"], tuple(sorted(f["ranks"]))) for f in findings}
    assert ("straggler", (3,)) in kinds, findings
    assert ("network_flap", (1, 5)) in kinds, findings
    stragglers = [f for f in findings if f["kind"] == "straggler"]
    assert all(f["ranks"] == [3] for f in stragglers), "a victim was named as a straggler"
