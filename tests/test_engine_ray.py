"""`megascope analyze --engine ray`: the event pass's batches as Ray tasks on a real local Ray cluster
(2 worker CPUs, started here with `ray start --head` on 127.0.0.1), merged by the driver; the tables
and findings are those of the local engine, for both event-pass variants and with a damaged segment
that only the workers find. A run on object storage (a moto S3 server on 127.0.0.1): each task mirrors
only its batch's ranks on its worker, the driver only the few ranks it reads itself."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

# single-machine mode (read when ray is imported): every Ray process binds 127.0.0.1, not the host's address;
# and the cluster checks a token of its own (inherited by `ray start` and the CLI), whatever ~/.ray holds
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'megascope[ray]')")

from megascope.analyzer.data import event_pass as ep  # noqa: E402
from megascope.analyzer.data.engine_ray import RayEngine  # noqa: E402
from megascope.analyzer.data.store import Store  # noqa: E402
from megascope.analyzer.run import Run  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")
CLUSTER_TEMP: dict[str, str] = {}
"""The running cluster's temp folder (its workers' MEGASCOPE_CACHE_DIR is under it)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster: one head node with 2 CPUs (two tasks at a time), its address. `ray start
    --block` in a session of its own, stopped by a signal: `ray stop` would stop every Ray cluster on
    the machine, other users' too."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    CLUSTER_TEMP["dir"] = temp
    cmd = [RAY, "start", "--head", "--block", "--num-cpus", "2", "--port", str(port), "--node-ip-address",
           "127.0.0.1", "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp,
           "--object-store-memory", str(200 * 2**20),
           "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())]
    # the workers' own cache (their mirrors of a URL run), apart from any driver's
    env = {**os.environ, "MEGASCOPE_CACHE_DIR": str(Path(temp) / "worker-cache")}
    head = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while subprocess.run([RAY, "status", "--address", address], capture_output=True, timeout=60).returncode:
            assert head.poll() is None, f"ray start failed: {head.stderr.read()[-2000:] if head.stderr else ''}"
            assert time.monotonic() < deadline, "the Ray cluster did not come up in 180 s"
            time.sleep(1)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        head.terminate()  # --block: the head stops the processes it started
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
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
            "peer_step": q("SELECT * FROM _p2p_peer_step ORDER BY rank, step, peer"),
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
    # the late launch beside the straggler saves nothing once replayed (the ranks wait for the straggler):
    # a victim by the what-if (graph/what_if_victims.py); the engines must agree either way
    assert "straggler" in kinds
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


def _segments_by_rank(root: Path) -> dict[str, set[str]]:
    """table -> rank folders holding at least one segment under `root` (a mirror)."""
    return {t: {p.parent.name for p in (root / t).glob("rank=*/*.parquet")} for t in ("events", "steps", "gpu")}


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 holding a simulated 16-rank run (written by `megascope simulate URL`),
    and the same run simulated locally: (S3Server, url, local copy)."""
    from tests.test_object_storage import BUCKET, S3Server, _aws_env, _start_moto, _stop

    proc, endpoint = _start_moto()
    try:
        s3 = S3Server(_aws_env(endpoint, tmp_path_factory.mktemp("driver-cache")), endpoint)
        s3.fs.create_dir(BUCKET)
        url = f"s3://{BUCKET}/runs/ray-16"
        args = ["--dp", "2", "--tp", "2", "--pp", "4", "--steps", "8", "--inject",
                "straggler:rank=9,slowdown=0.5,from=3", "--inject", "late_launch:rank=5,ms=20,every=2,from=1"]
        copy = tmp_path_factory.mktemp("sim") / "run"
        for target in (url, str(copy)):  # simulate is deterministic: the bucket's run and a local one
            done = s3.megascope("simulate", target, *args)
            assert done.returncode == 0, done.stderr[-3000:]
        yield s3, url, copy
    finally:
        _stop(proc)


def _mirror(cache: Path, url: str) -> Path:
    return cache / "mirrors" / "s3" / url.removeprefix("s3://")


def test_url_run_each_task_mirrors_its_batch(bucket, cluster, tmp_path):
    """`analyze s3://... --engine ray`: the findings of the local engine on a local copy; the driver's
    mirror holds the segments of rank 0 only (the time origin, the wait-row check), the workers'
    mirrors every rank's events and steps. The cluster was started without AWS variables: the tasks
    reach the bucket only through the driver's AWS_* that the engine forwards."""
    s3, url, copy = bucket
    out = {}
    html = tmp_path / "report.html"  # the heatmaps too come from the merged tables, not from raw segments
    for name, target, extra in (("local", str(copy), []),
                                ("ray", url, ["--engine", "ray", "--address", cluster, "--html", str(html)])):
        done = s3.megascope("analyze", target, "--json", "--no-what-if", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = json.loads(done.stdout)
    assert html.stat().st_size > 10_000
    assert out["local"]["findings"] and out["local"]["findings"] == out["ray"]["findings"]
    assert out["local"]["mfu"] == out["ray"]["mfu"]
    driver = _mirror(Path(s3.env["MEGASCOPE_CACHE_DIR"]), url)
    held = _segments_by_rank(driver)
    assert (driver / "run.json").is_file()
    assert held == {"events": {"rank=00000"}, "steps": {"rank=00000"}, "gpu": set()}, held
    ranks = {f"rank={r:05d}" for r in range(16)}
    worker = _segments_by_rank(_mirror(Path(CLUSTER_TEMP["dir"]) / "worker-cache", url))
    assert worker == {"events": ranks, "steps": ranks, "gpu": set()}


def test_url_run_in_batches_with_a_damaged_segment(bucket, cluster, monkeypatch, tmp_path):
    """Two batches of rank patterns (rank=0000?, rank=0001?) planned from the bucket's listing, and a
    truncated events segment of rank 6 that only a task finds: the local engine's tables on a local
    copy, and the driver mirrors rank 6 (for the incomplete-data bounds) besides rank 0."""
    from megascope.analyzer.data.remote_run import PartialMirror
    from megascope.tracer.storage import locate

    s3, _, copy = bucket
    damaged = tmp_path / "run"
    shutil.copytree(copy, damaged, ignore=shutil.ignore_patterns("analysis"))
    victim = sorted((damaged / "events" / "rank=00006").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    for name, value in s3.env.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEGASCOPE_CACHE_DIR", str(tmp_path / "cache"))
    url = "s3://megascope-test/runs/ray-16-damaged"
    location = locate(url)
    files = sorted(p for p in damaged.rglob("*") if p.is_file())
    for path in sorted(files, key=lambda p: p.name == "run.json"):  # the manifest last
        location.write_bytes(path.relative_to(damaged).as_posix(), path.read_bytes())
    monkeypatch.setattr(ep, "BATCH_RANKS", 10)
    local = Run(Store(damaged))
    remote = Run(PartialMirror(url), engine=RayEngine(address=cluster))
    assert remote.store.rank_prefix_batches(10) == [["rank=0000?"], ["rank=0001?"]]
    a, b = _tables(local), _tables(remote)
    mirror = _mirror(tmp_path / "cache", url)
    assert remote.store.damaged == [("events", str(mirror / victim.relative_to(damaged)))]
    assert set(b["rank_step_incomplete"]["rank"]) == {6}
    pd.testing.assert_frame_equal(a["rank_step"], b["rank_step"], check_exact=True)
    for name in ("peer_step", "collectives", "late", "rank_step_incomplete"):
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-12, obj=name)
    assert _findings(local) and _findings(local) == _findings(remote)
    assert local.incomplete_data() == remote.incomplete_data()
    held = _segments_by_rank(mirror)
    # beside rank 0 and the damaged rank the driver reads what the victim rule's what-if replays
    # (graph/what_if_victims.py: every rank's events of a few steps, as Run.what_if does)
    assert {"rank=00000", "rank=00006"} <= held["events"] and held["events"] == held["steps"], held


def test_ray_engine_reads_the_summaries_at_the_edge(run_dir, cluster, monkeypatch, tmp_path):
    """A run whose ranks summarized their steps at the edge: each task reads its batch's summaries
    (scan_edge_batch), and the tables and findings are the local engine's (which reads them in this
    process)."""
    from megascope.tracer.edge_summary import summarize_run

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("analysis"))
    summarize_run(copy)
    plans = []
    real = RayEngine.map_batches

    def recording(self, store, batches, plan):
        plans.append(plan)
        return real(self, store, batches, plan)

    monkeypatch.setattr(RayEngine, "map_batches", recording)
    local, remote = _both(copy, cluster, monkeypatch, timeline=True)
    a, b = _tables(local), _tables(remote)
    assert plans and all(p.edge for p in plans)
    assert len(a["rank_step"]) == 16 * 8 and len(a["collectives"]) > 0
    for name in ("rank_step", "peer_step", "collectives", "late", "rank_step_incomplete"):
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-12, obj=name)
    assert "straggler" in {f["kind"] for f in _findings(local)}
    assert _findings(local) == _findings(remote)
