"""Through the real `megascope` command: train (elastic launch, 4 gloo ranks) -> trace -> analyze -> export."""

import json
import os
import subprocess
import sys

import duckdb
import pytest

pytestmark = pytest.mark.slow


def megascope(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascope", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("e2e") / "run"
    temp = tmp_path_factory.mktemp("e2e-tmpdir")  # the job's temporary files, to see what it leaves
    proc = megascope("train", "--preset", "tiny", "--dp", "2", "--pp", "2", "--steps", "16",
                     "--run-dir", str(run), "--inject", "straggler:rank=1,slowdown=3,from=5",
                     env=dict(os.environ, TMPDIR=str(temp)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout, temp


def test_train_prints_progress_and_writes_the_run_directory(straggler_run):
    run, stdout, _ = straggler_run
    lines = [ln for ln in stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 16 and "mfu(%)" in lines[0] and "tokens/s" in lines[0]
    assert "done: 16 steps" in stdout
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["topology"]["world"] == 4 and manifest["schedule"] == "1f1b"
    assert manifest["peak_flops"]["source"].startswith("measured:gemm")
    assert set(manifest["clock_offsets_ns"]) == {"0", "1", "2", "3"}
    steps = duckdb.sql(f"select rank, count(*) n, count(loss) filter (where not isnan(loss)) l "
                       f"from read_parquet('{run}/steps/*/*.parquet', hive_partitioning=false) "
                       f"group by rank order by rank").fetchall()
    assert [(r, n) for r, n, _ in steps] == [(r, 16) for r in range(4)]
    names = {n for (n,) in duckdb.sql(f"select distinct name from read_parquet("
                                      f"'{run}/events/*/*.parquet', hive_partitioning=false)").fetchall()}
    assert {"forward", "backward", "send_forward", "recv_forward", "send_backward", "recv_backward",
            "grad_reduce_scatter", "param_all_gather", "grad_norm", "optimizer", "data_wait"} <= names


def test_train_leaves_no_temporary_files_behind(straggler_run):
    # torch's elastic agent made one /tmp/torchelastic_* per launch and never removed it; Inductor's
    # torchinductor_<user> is a cache kept on purpose (it makes the next run's compilation fast)
    _, _, temp = straggler_run
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_analyze_names_the_injected_straggler_not_its_victims(straggler_run):
    run, _, _ = straggler_run
    proc = megascope("analyze", str(run), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["mfu"]["mean"] > 0 and len(report["mfu"]["per_step"]) == 16
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    assert stragglers, report["findings"]
    assert stragglers[0]["ranks"] == [1]
    assert abs(stragglers[0]["steps"][0] - 5) <= 3  # onset error within 3 steps of the injection


def test_export_writes_a_perfetto_trace(straggler_run, tmp_path):
    run, _, _ = straggler_run
    out = tmp_path / "trace.json"
    proc = megascope("export", str(run), "--perfetto", str(out), "--steps", "5:6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = json.loads(out.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert {e.get("pid") for e in events if e.get("ph") == "X"} >= {0, 1, 2, 3}


def test_bad_layout_and_bad_fault_spec_fail_before_launch(tmp_path):
    proc = megascope("train", "--preset", "tiny", "--dp", "3", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "micro_batch*dp" in proc.stderr
    proc = megascope("train", "--preset", "tiny", "--inject", "straggler:rank=7,slowdown=2")
    assert proc.returncode == 2 and "outside the world" in proc.stderr
    assert not (tmp_path / "r").exists()
