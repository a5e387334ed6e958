"""Run directories on object storage, against a real S3-compatible HTTP server.

moto's standalone server (`moto_server`, from the test extra's moto[server]) is started on 127.0.0.1 on a
free port for this module; every `megascope` command runs as a subprocess with the standard AWS variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) pointing at it, and MEGASCOPE_CACHE_DIR in a temporary folder.
A 2x2 traced job writes s3://BUCKET/..., which analyze, export, watch and the dashboard then read; a job
killed with SIGKILL mid-run leaves only complete objects; simulate and import round-trip through a URL.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.test_analyzer_restarts import runs  # noqa: F401 - a fixture: a run restarted mid-way

pytestmark = pytest.mark.slow

BUCKET = "megascope-test"
TOKEN = "object-store-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, env: dict[str, str], endpoint: str) -> None:
        self.env, self.endpoint = env, endpoint
        self.fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="testing",
                                    secret_key="testing", region="us-east-1", allow_bucket_creation=True)

    def objects(self, prefix: str) -> dict[str, int]:
        """Every object under BUCKET/prefix: relative key -> size."""
        infos = self.fs.get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
        base = f"{BUCKET}/{prefix}/"
        return {i.path[len(base):]: i.size for i in infos if i.type == pafs.FileType.File}

    def megascope(self, *args: str, timeout: float = 600, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megascope", *args], capture_output=True, text=True,
                              timeout=timeout, env=env or self.env)


def _start_moto(extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """moto's standalone S3 server on a free 127.0.0.1 port, once it answers HTTP."""
    server = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    assert Path(server).exists(), "moto_server not found: pip install 'moto[server]' (the test extra)"
    port = _free_port()
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, **(extra_env or {})})
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2).read()
            return proc, endpoint
        except urllib.error.HTTPError:  # an S3 error document: it answers
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise AssertionError("moto_server did not start") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


def _aws_env(endpoint: str, cache: Path, key: str = "testing") -> dict[str, str]:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": key, "AWS_ENDPOINT_URL": endpoint,
           "AWS_REGION": "us-east-1", "MEGASCOPE_CACHE_DIR": str(cache)}
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> S3Server:
    proc, endpoint = _start_moto()
    try:
        server = S3Server(_aws_env(endpoint, tmp_path_factory.mktemp("cache")), endpoint)
        server.fs.create_dir(BUCKET)
        yield server
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def traced(s3: S3Server) -> str:
    """A 2x2 job (dp=2, pp=2) with a straggler on rank 1, traced into the bucket."""
    url = f"s3://{BUCKET}/jobs/traced-2x2"
    proc = s3.megascope("train", "--preset", "tiny", "--dp", "2", "--pp", "2", "--steps", "16", "--run-dir", url,
                        "--inject", "straggler:rank=1,slowdown=3,from=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return url


def _findings(report: dict) -> list[tuple[str, list[int]]]:
    return sorted((f["kind"], sorted(f["ranks"])) for f in report["findings"])


def test_traced_job_writes_segments_and_run_json_to_the_bucket(s3, traced):
    objects = s3.objects("jobs/traced-2x2")
    manifest = json.loads(s3.fs.open_input_stream(f"{BUCKET}/jobs/traced-2x2/run.json").read())
    assert manifest["topology"]["world"] == 4 and set(manifest["clock_offsets_ns"]) == {"0", "1", "2", "3"}
    for table in ("events", "steps"):
        ranks = {name.split("/")[1] for name in objects if name.startswith(f"{table}/")}
        assert ranks == {f"rank={r:05d}" for r in range(4)}, sorted(objects)
    assert "health.json" in objects  # the supervisor's file, uploaded from the scratch folder at the end
    assert not [n for n in objects if n.rsplit("/", 1)[-1].startswith(".") or n.endswith(".tmp")]


def test_analyze_reads_the_bucket_like_a_local_copy(s3, traced, tmp_path):
    local = tmp_path / "copy"
    pafs.copy_files(f"{BUCKET}/jobs/traced-2x2", str(local), source_filesystem=s3.fs,
                    destination_filesystem=pafs.LocalFileSystem())
    remote = s3.megascope("analyze", traced, "--json", "--no-what-if")
    assert remote.returncode == 0, remote.stderr[-3000:]
    copied = s3.megascope("analyze", str(local), "--json", "--no-what-if")
    assert copied.returncode == 0, copied.stderr[-3000:]
    found = _findings(json.loads(remote.stdout))
    assert found == _findings(json.loads(copied.stdout)), (found, copied.stdout[-2000:])
    assert ("straggler", [1]) in found, found
    # the second read syncs incrementally: nothing changed, the same verdict
    again = s3.megascope("analyze", traced, "--json", "--no-what-if")
    assert again.returncode == 0 and _findings(json.loads(again.stdout)) == found


def test_export_from_the_bucket(s3, traced, tmp_path):
    out = tmp_path / "trace.json"
    proc = s3.megascope("export", traced, "--perfetto", str(out), "--steps", "5:6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = json.loads(out.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert {e.get("pid") for e in events if e.get("ph") == "X"} >= {0, 1, 2, 3}


def test_watch_on_a_finished_bucket_run_gives_the_verdict(s3, traced):
    proc = s3.megascope("watch", traced, "--no-summary", "--poll", "0.5", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(line.split()[2:4] == ["FINAL", "straggler"] for line in proc.stdout.splitlines()), proc.stdout


def _get(url: str, headers: dict[str, str]) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_dashboard_serves_the_bucket_run(s3, traced):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "dashboard", traced, "--port", str(port),
                             "--token", TOKEN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s3.env)
    try:
        line = proc.stdout.readline()
        assert "serving 1 run(s) at http://127.0.0.1" in line, (line, proc.poll(), proc.stderr.read()[-2000:])
        base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
        status, body = _get(base + "/", auth)
        assert status == 200 and "<title>megascope</title>" in body
        status, layout = _get(base + "/_dash-layout", auth)
        assert status == 200 and "traced-2x2" in layout  # the run is in the run picker
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_job_killed_mid_run_leaves_only_complete_objects(s3, tmp_path):
    url = f"s3://{BUCKET}/jobs/killed"
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "2", "--pp", "2",
                             "--steps", "2000", "--run-dir", url, "--set", "trace.flush_interval_s=0.05"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=s3.env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while sum(n.startswith("events/") for n in s3.objects("jobs/killed")) < 16:
            assert proc.poll() is None and time.monotonic() < deadline, "the job wrote no segments"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every rank, mid-flush
        proc.wait(timeout=60)
    time.sleep(1.0)
    objects = s3.objects("jobs/killed")
    assert "run.json" in objects
    json.loads(s3.fs.open_input_stream(f"{BUCKET}/jobs/killed/run.json").read())
    segments = [n for n in objects if n.endswith(".parquet")]
    assert len(segments) >= 16 and set(objects) - set(segments) <= {"run.json"}, sorted(objects)
    rows = 0
    for name in segments:  # every object is a whole, readable Parquet file
        rows += pq.read_table(f"{BUCKET}/jobs/killed/{name}", filesystem=s3.fs).num_rows
    assert rows > 0
    report = s3.megascope("analyze", url, "--json", "--no-what-if")
    assert report.returncode == 0, report.stderr[-3000:]


def test_missing_bucket_and_unreachable_store_are_one_line(s3):
    for command in (["analyze", f"s3://no-such-bucket-{os.getpid()}/run"], ["export", "s3://no-such-bucket/r",
                                                                           "--perfetto", "/dev/null"]):
        proc = s3.megascope(*command)
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "does not exist" in proc.stderr and "no-such-bucket" in proc.stderr
    proc = s3.megascope("analyze", f"s3://{BUCKET}/not-a-run")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "no run.json" in proc.stderr
    closed = {**s3.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}"}
    proc = s3.megascope("analyze", f"s3://{BUCKET}/x", env=closed, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "cannot reach the object store" in proc.stderr
    proc = s3.megascope("train", "--preset", "tiny", "--steps", "2", "--run-dir", "s3://no-such-bucket/r")
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_credentials_are_one_line(tmp_path):
    """moto with authentication on (INITIAL_NO_AUTH_ACTION_COUNT=0) refuses keys it does not know."""
    proc, endpoint = _start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        env = _aws_env(endpoint, tmp_path / "cache", key="not-a-key")
        for command in (["analyze", f"s3://{BUCKET}/run"], ["simulate", f"s3://{BUCKET}/sim", "--steps", "2"]):
            done = subprocess.run([sys.executable, "-m", "megascope", *command], capture_output=True, text=True,
                                  timeout=120, env=env)
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert len(done.stderr.strip().splitlines()) == 1 and "access denied" in done.stderr, done.stderr
    finally:
        _stop(proc)


def test_simulate_to_a_url_round_trips(s3, tmp_path):
    args = ["--dp", "2", "--tp", "1", "--pp", "2", "--steps", "8", "--inject", "straggler:rank=2,slowdown=3"]
    url = f"s3://{BUCKET}/sim/straggler"
    proc = s3.megascope("simulate", url, *args)
    assert proc.returncode == 0 and url in proc.stdout, proc.stderr
    local = tmp_path / "sim"
    assert s3.megascope("simulate", str(local), *args).returncode == 0
    files = {str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()}
    assert set(s3.objects("sim/straggler")) == files
    reports = [json.loads(s3.megascope("analyze", run, "--json", "--no-what-if").stdout) for run in (url, str(local))]
    assert _findings(reports[0]) == _findings(reports[1]) and ("straggler", [2]) in _findings(reports[0])
    again = s3.megascope("simulate", url, *args)
    assert again.returncode == 2 and "--force" in again.stderr
    assert s3.megascope("simulate", url, *args, "--force").returncode == 0


def _fr_entry(pg: tuple[str, str], seq: int, t: int, retired: bool) -> dict:
    return {"record_id": seq, "pg_id": int(pg[0]), "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": "nccl:all_reduce", "time_created_ns": t, "input_sizes": [[1024]],
            "input_dtypes": ["BFloat16"], "output_sizes": [[1024]], "output_dtypes": ["BFloat16"],
            "state": "completed" if retired else "started", "time_discovered_started_ns": t + 10,
            "time_discovered_completed_ns": t + 500 if retired else None, "retired": retired,
            "timeout_ms": 600000, "is_p2p": False, "frames": []}


def test_import_to_a_url_round_trips(s3, tmp_path):
    """Flight-recorder dumps of a dp=2 job whose rank 1 never joined the second all-reduce."""
    config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    for rank in range(2):
        entries = [_fr_entry(("0", "default_pg"), 1, 1000, True)] + (
            [_fr_entry(("0", "default_pg"), 2, 3000, False)] if rank == 0 else [])
        dump = {"version": "2.4", "pg_config": config, "pg_status": {}, "entries": entries}
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    dumps = [str(tmp_path / f"nccl_trace_rank_{r}") for r in range(2)]
    url = f"s3://{BUCKET}/imported/fr"
    proc = s3.megascope("import", "flight-recorder", *dumps, "--out", url, "--dp", "2")
    assert proc.returncode == 0 and url in proc.stdout, proc.stderr
    local = tmp_path / "local"
    assert s3.megascope("import", "flight-recorder", *dumps, "--out", str(local), "--dp", "2").returncode == 0
    assert set(s3.objects("imported/fr")) == {str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()}
    reports = [json.loads(s3.megascope("analyze", run, "--json", "--no-what-if").stdout) for run in (url, str(local))]
    assert _findings(reports[0]) == _findings(reports[1]) == [("hang", [1])]
    again = s3.megascope("import", "flight-recorder", *dumps, "--out", url, "--dp", "2")
    assert again.returncode == 2 and "already holds" in again.stderr and "Traceback" not in again.stderr


def test_an_fsspec_only_scheme_carries_segments_and_the_manifest():
    """memory:// has no pyarrow filesystem: it goes through fsspec (whose paths start with '/')."""
    import pyarrow as pa

    from megascope.tracer import run_dir as rd
    from megascope.tracer.sink import ParquetSegmentSink
    from megascope.tracer.storage import locate

    url = f"memory://megascope-{os.getpid()}/run"
    ParquetSegmentSink(url, 3).write("steps", pa.table({"step": [0, 1]}))
    ParquetSegmentSink(url, 3).write("steps", pa.table({"step": [2]}))  # a restarted rank appends
    rd.write_manifest(url, {"run_id": "m"})
    assert rd.read_manifest(url)["run_id"] == "m" and rd.run_entries(url) == ["run.json", "steps"]
    assert sorted(locate(url).list_files()) == ["run.json", "steps/rank=00003/seg-000000.parquet",
                                                "steps/rank=00003/seg-000001.parquet"]


def test_partial_mirror_fetches_ranks_as_read_and_keeps_the_latest_attempts(runs, tmp_path, monkeypatch):  # noqa: F811
    """The driver's partial mirror of `analyze URL --engine ray` (remote_run.PartialMirror), on a run
    restarted mid-way (tests/test_analyzer_restarts.py) in an fsspec store: it starts with run.json and
    the small files, fetches a rank's segments when that rank is read, and finds the restart bounds of
    the ranks it fetched later, so its views equal a local Store's once it holds every rank."""
    import pandas as pd

    from megascope.analyzer.data.remote_run import PartialMirror
    from megascope.analyzer.data.store import Store
    from megascope.tracer.storage import locate
    from tests.test_analyzer_restarts import _clone

    restarted = _clone(runs["restarted"], tmp_path / "run", runs["restart_ns"])
    monkeypatch.setenv("MEGASCOPE_CACHE_DIR", str(tmp_path / "cache"))
    url = "memory://partial/restarted"
    location = locate(url)
    for path in sorted((p for p in restarted.rglob("*") if p.is_file()), key=lambda p: p.name == "run.json"):
        location.write_bytes(path.relative_to(restarted).as_posix(), path.read_bytes())
    local, partial = Store(restarted), PartialMirror(url)
    assert not any(partial.files[t] for t in ("events", "steps"))
    one = "SELECT * FROM {} ORDER BY ALL"
    pd.testing.assert_frame_equal(local.query(one.format(local.table_source("steps", [1]))),
                                  partial.query(one.format(partial.table_source("steps", [1]))))
    assert {p.split("/")[-2] for p in partial.files["events"]} == {"rank=00001"}
    assert partial.attempt_bounds > 0
    partial.ensure_ranks(None)
    assert partial.attempt_bounds == local.attempt_bounds
    for table in ("steps", "events"):
        pd.testing.assert_frame_equal(local.query(one.format(table)), partial.query(one.format(table)))


def test_held_store_reads_only_its_ranks_while_others_fill_the_folder(runs, tmp_path):  # noqa: F811
    """A Ray task's store over the mirror its host shares (remote_run.HeldStore): a segment another
    task fetched meanwhile, here a damaged one of rank 0, is neither read nor reported by the store of
    rank 1, while a plain Store of the same folder trips on it (CI saw a task fail on exactly this)."""
    from megascope.analyzer.data.remote_run import HeldStore, RankFilter
    from megascope.analyzer.data.store import Store
    from tests.test_analyzer_restarts import _clone

    folder = _clone(runs["reference"], tmp_path / "mirror", None)
    victim = sorted((folder / "events" / "rank=00000").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # what a glob of the whole folder would meet
    assert Store(folder).damaged == [("events", str(victim))]
    held = HeldStore(folder, RankFilter(["rank=00001"], ("events", "steps")))
    assert held.damaged == [] and not held.warnings
    for table in ("events", "steps"):
        assert held.query(f"SELECT DISTINCT rank FROM {table}")["rank"].tolist() == [1]
    assert held.files["gpu"] == held.files["kernels"] == []


def test_run_open_takes_a_url(runs, tmp_path, monkeypatch):  # noqa: F811
    """The Python API opens a run on object storage as the CLI does: Run.open(URL) reads a mirror of
    it, with the findings of the local run."""
    from megascope.analyzer.run import Run
    from megascope.tracer.storage import locate

    local = runs["reference"]
    monkeypatch.setenv("MEGASCOPE_CACHE_DIR", str(tmp_path / "cache"))
    url = "memory://api/reference"
    location = locate(url)
    for path in sorted((p for p in local.rglob("*") if p.is_file() and "analysis" not in p.parts),
                       key=lambda p: p.name == "run.json"):
        location.write_bytes(path.relative_to(local).as_posix(), path.read_bytes())
    remote = Run.open(url)
    assert remote.path != local and str(tmp_path / "cache") in str(remote.path)
    expected = [(f.kind, f.ranks, f.steps) for f in Run.open(local).findings()]
    assert expected and [(f.kind, f.ranks, f.steps) for f in remote.findings()] == expected


def test_follower_backs_off_when_a_sync_is_slow(runs, tmp_path, monkeypatch):  # noqa: F811
    """A live reader's follower lists the whole run each sync: it waits at least 10x the last sync's
    duration before the next one, so a run with 10^5 objects is not listed back to back."""
    from megascope.analyzer.data.remote_run import Follower, mirror_folder
    from megascope.tracer.storage import locate

    monkeypatch.setenv("MEGASCOPE_CACHE_DIR", str(tmp_path / "cache"))
    url = "memory://follow/reference"
    local = runs["reference"]
    for path in sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: p.name == "run.json"):
        locate(url).write_bytes(path.relative_to(local).as_posix(), path.read_bytes())
    follower = Follower(url, mirror_folder(url), interval_s=0.2).start()
    try:
        deadline = time.monotonic() + 30
        while follower.last_sync_s == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        follower.stop()
    assert follower.last_sync_s > 0 and (mirror_folder(url) / "run.json").is_file()
    assert follower.next_wait_s() == max(0.2, 10 * follower.last_sync_s)
    follower.last_sync_s = 3.0  # a listing of a very large run
    assert follower.next_wait_s() == 30.0
