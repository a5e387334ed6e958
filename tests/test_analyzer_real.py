"""The analyzer on traces of the real trainer (not the simulator): a straggler run names the
straggler (not its data-parallel peer, not its stage) near its onset, and a clean run gives no
finding at all, despite the timing noise of several ranks sharing two CPU cores.

Two short `megascope train` runs (dp=2 x pp=2, 12 steps); analysis through the Python API.
"""

import os
import resource
import subprocess
import sys
import time

import pytest

from megascope.analyzer import Run, build_report

pytestmark = pytest.mark.slow


FOREIGN_SHARE_MAX = 0.25
"""A clean run is judged only if other processes took at most this share of the box's CPU while it ran:
4 ranks on 2 cores leave no spare core, so another job's CPU is taken from some rank, and a rank slowed
that way for several steps is a real (external) straggler, not a false one. Measured: at load 5-6 from
other engineers' benchmarks a clean run showed rank 3 1.76x slow for 8 steps; the same test passed
repeatedly at load < 2."""


def _busy_cpu_s() -> float:
    """CPU seconds every process of the machine has used so far (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def train_measuring_load(run_dir, layout: list[str], steps: int, *inject: str) -> tuple[Run, float]:
    """A `megascope train --preset tiny` run (`layout`: e.g. ["--dp", "2"]), and the share of the
    machine's CPU that processes other than it took meanwhile."""
    cmd = [sys.executable, "-m", "megascope", "train", "--preset", "tiny", *layout,
           "--steps", str(steps), "--run-dir", str(run_dir)]
    for spec in inject:
        cmd += ["--inject", spec]
    busy, own = _busy_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the trainer and its ranks, all waited for
    own_s = after.ru_utime + after.ru_stime - own.ru_utime - own.ru_stime
    foreign_s = max(_busy_cpu_s() - busy - own_s, 0.0)
    return Run.open(run_dir), foreign_s / ((time.monotonic() - start) * os.cpu_count())


def _train(run_dir, *inject: str) -> tuple[Run, float]:
    return train_measuring_load(run_dir, ["--dp", "2", "--pp", "2"], 12, *inject)


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("real") / "straggler", "straggler:rank=3,slowdown=3,from=5")[0]


@pytest.fixture(scope="module")
def clean_run_and_load(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("real") / "clean")


@pytest.fixture(scope="module")
def clean_run(clean_run_and_load):
    return clean_run_and_load[0]


def test_real_straggler_is_found_with_its_onset(straggler_run):
    found = straggler_run.findings()
    stragglers = [f for f in found if f.kind == "straggler"]
    assert [f.ranks for f in stragglers] == [[3]], [(f.kind, f.ranks, f.steps) for f in found]
    assert 4 <= stragglers[0].steps[0] <= 8  # injected at 5; noise may pull one step early
    assert stragglers[0].severity > 1.5
    # its victims (rank 2 shares its stage, rank 1 feeds it) and its stage are not blamed
    assert [f for f in found if f.kind != "straggler"] == []


def test_real_clean_run_has_no_findings(clean_run_and_load):
    run, foreign = clean_run_and_load
    found = run.findings()
    if found and foreign > FOREIGN_SHARE_MAX:
        pytest.skip(f"other processes took {foreign:.0%} of the CPU during the clean run (> "
                    f"{FOREIGN_SHARE_MAX:.0%}): it was not clean; findings {[(f.kind, f.ranks) for f in found]}")
    assert found == [], ([(f.kind, f.ranks, f.steps, f.summary) for f in found], f"foreign CPU {foreign:.0%}")


def test_real_run_accounting_is_consistent(clean_run):
    rs = clean_run.rank_steps()
    # own compute never exceeds the step, and nested waits were taken out of it, not added
    assert (rs.forward_s >= 0).all() and (rs.backward_s >= 0).all()
    assert (rs.compute_s <= rs.step_time_s * 1.01).all()
    bd = clean_run.breakdown()
    parts = bd[["compute_s", "exposed_comm_s", "bubble_s", "data_wait_s", "other_s"]].sum(axis=1)
    st = rs.set_index(["step", "rank"]).step_time_s.loc[list(zip(bd.step, bd["rank"]))].to_numpy()
    assert abs(parts.to_numpy() - st).max() < 1e-6
    # the report (what-if replays included) says what the run's findings say: whether a clean run has
    # none is test_real_clean_run_has_no_findings's question, judged there only when the box was quiet
    report = build_report(clean_run, with_what_if=True)
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [(f.kind, f.ranks) for f in clean_run.findings()]
    judged = report["findings"][:clean_run.settings.report.max_what_if]
    assert all("what_if" in f for f in judged if f["kind"] != "hang")
