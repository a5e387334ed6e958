"""`megascope analyze --engine ray`: the event pass's batches as Ray tasks on a real local Ray cluster
(2 worker CPUs, started here with `ray start --head` on 127.0.0.1), merged by the driver; the tables
and findings are those of the local engine, for both event-pass variants and with a damaged segment
that only the workers find."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest

# single-machine mode (read when ray is imported): every Ray process binds 127.0.0.1, not the host's address;
# and the cluster checks a token of its own (inherited by `ray start` and the CLI), whatever ~/.ray holds
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'megascope[ray]')")

from megascope.analyzer import event_pass as ep  # noqa: E402
from megascope.analyzer.engine_ray import RayEngine  # noqa: E402
from megascope.analyzer.run import Run  # noqa: E402
from megascope.analyzer.store import Store  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster: one head node with 2 CPUs (two tasks at a time), its address."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    cmd = [RAY, "start", "--head", "--num-cpus", "2", "--port", str(port), "--node-ip-address", "127.0.0.1",
           "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp,
           "--object-store-memory", str(200 * 2**20),
           "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())]
    try:
        started = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop"], capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def run_dir(simulated_run):
    return simulated_run(dp=2, tp=2, pp=4, steps=8, inject=["straggler:rank=9,slowdown=0.5,from=3",
                                                            "late_launch:rank=5,ms=20,every=2,from=1"])


def _tables(run: Run) -> dict[str, pd.DataFrame]:
    run.findings()
    q = run.store.query
    return {"rank_step": q("SELECT * FROM rank_step ORDER BY rank, step"),
            "rank_step_incomplete": q("SELECT * FROM rank_step_incomplete ORDER BY rank, step"),
            "peer_step": q("SELECT * FROM _rank_peer_step ORDER BY rank, step, peer"),
            "collectives": q('SELECT * FROM collective_instances ORDER BY "group", instance, seq'),
            "late": q("SELECT * FROM late_arrivals ORDER BY rank, step")}


def _rounded(value):
    """Floats to 9 significant digits (sums merged in another order may differ in the last bits)."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _findings(run: Run) -> list[dict]:
    return [_rounded(f.to_dict()) for f in run.findings()]


def _both(path: Path, address: str, monkeypatch, timeline: bool, damaged: Path | None = None):
    """(local, ray) Runs over `path` with 6 batches of ranks (3 ranks each)."""
    monkeypatch.setattr(ep, "BATCH_RANKS", 3)
    monkeypatch.setattr(ep, "TIMELINE_ALWAYS_RANKS", 10**9 if timeline else 0)
    monkeypatch.setattr(ep, "needs_timeline", lambda store, base, tolerance=0.01: timeline)
    runs = []
    for engine in (None, RayEngine(address=address)):
        store = Store(path)
        if damaged is not None:  # as if listed before the open-time check caught it: found mid-pass
            store.files["events"].append(str(damaged))
            store.warnings.clear()
            store.damaged.clear()
            store._excluded.discard("events")
            store._make_view("events")
        runs.append(Run(store, engine=engine))
    return runs


@pytest.mark.parametrize("timeline", [True, False])
def test_ray_engine_gives_the_local_tables_and_findings(run_dir, cluster, monkeypatch, timeline):
    local, remote = _both(run_dir, cluster, monkeypatch, timeline)
    a, b = _tables(local), _tables(remote)
    assert len(a["rank_step"]) == 16 * 8 and len(a["collectives"]) > 0 and len(a["late"]) > 0
    pd.testing.assert_frame_equal(a["rank_step"], b["rank_step"], check_exact=True)
    for name in ("peer_step", "collectives", "late", "rank_step_incomplete"):
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-12, obj=name)
    kinds = {f["kind"] for f in _findings(local)}
    assert {"straggler", "late_launch"} <= kinds
    assert _findings(local) == _findings(remote)


def test_damaged_segment_found_by_a_worker(run_dir, cluster, monkeypatch, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("analysis"))
    victim = sorted((copy / "events" / "rank=00006").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    local, remote = _both(copy, cluster, monkeypatch, timeline=False, damaged=victim)
    a, b = _tables(local), _tables(remote)
    for run in (local, remote):
        assert run.store.damaged == [("events", str(victim))]
        assert any("rank=00006" in w for w in run.warnings)
    assert set(b["rank_step_incomplete"]["rank"]) == {6} and 6 not in set(b["rank_step"]["rank"])
    pd.testing.assert_frame_equal(a["rank_step"], b["rank_step"], check_exact=True)
    pd.testing.assert_frame_equal(a["collectives"], b["collectives"], check_exact=False, rtol=1e-12)
    assert _findings(local) == _findings(remote)


def test_cli_engine_ray(run_dir, cluster, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("analysis"))
    out = {}
    for name, extra in (("local", []), ("ray", ["--engine", "ray", "--address", cluster])):
        proc = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(copy), "--json", "--no-what-if",
                               *extra], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = json.loads(proc.stdout)
    assert out["local"]["findings"] and out["local"]["findings"] == out["ray"]["findings"]
    bad = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(copy), "--address", cluster],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "add --engine ray" in bad.stderr and "Traceback" not in bad.stderr
