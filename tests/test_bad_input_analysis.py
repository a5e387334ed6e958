"""Bad input to `megascope analyze` and `export` (issue 14), through the real command: each case ends
in one clear line on stderr, the right exit code, no traceback, and nothing written that should not be.
Damaged segments are dropped, and the rank-steps they held are reported as incomplete data, never
judged slow or fast. Runs come from the simulator, cut into several segments per rank like a traced
run's periodic flushes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from megascope.analyzer import Run

STEPS = 12
STRAGGLER = 3  # stage 1 (ranks 2, 3); the damage below hits rank 1, stage 0


def megascope(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascope", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def assert_refused(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    """Exit `code`, one line on stderr holding every needle, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def files_of(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


WORLD, MICRO_BATCHES = 4, 8
SEGMENTED = dict(dp=2, tp=1, pp=2, steps=STEPS, micro_batches=MICRO_BATCHES,
                 rows_per_window=WORLD * (6 * MICRO_BATCHES + 4) * 3)
"""dp=2 pp=2 over 12 steps, 4 segments per rank and table (steps 0-2, 3-5, 6-8, 9-11)."""


@pytest.fixture(scope="module")
def clean(simulated_run) -> Path:
    return simulated_run(**SEGMENTED)


@pytest.fixture(scope="module")
def straggler(simulated_run) -> Path:
    return simulated_run(**SEGMENTED, inject=[f"straggler:rank={STRAGGLER},slowdown=0.3,from=2"])


def copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


# ---- run.json ------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, needle", [
    ("[]", "not a megascope run.json (it holds an array"),
    ("null", "not a megascope run.json (it holds null"),
    ('"run"', "not a megascope run.json (it holds a string"),
])
def test_run_json_that_is_not_an_object(clean, tmp_path, content, needle):
    run = copy(clean, tmp_path)
    (run / "run.json").write_text(content)
    before = files_of(run)
    assert_refused(megascope("analyze", run), needle, "pass a run directory")
    assert files_of(run) == before  # no summary cache, nothing else written


def test_schema_version_of_the_wrong_type(clean, tmp_path):
    run = copy(clean, tmp_path)
    manifest = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**manifest, "schema_version": "1"}))
    before = files_of(run)
    proc = megascope("analyze", run)
    assert_refused(proc, "schema_version has the wrong type", 'a string "1"', "expected an integer")
    assert "written with" not in proc.stderr
    assert files_of(run) == before


# ---- damaged segments ----------------------------------------------------------------------------
def damage(segment: Path, how: str) -> None:
    data = segment.read_bytes()
    segment.write_bytes(b"" if how == "empty" else data[: len(data) // 3])


@pytest.mark.parametrize("table", ["events", "steps"])
@pytest.mark.parametrize("how", ["truncated", "empty"])
def test_rank0_first_segment_damaged_is_dropped_with_a_warning(clean, tmp_path, table, how):
    """The views bind their columns from the first file: rank 0's first segment used to fail the view."""
    run = copy(clean, tmp_path)
    victim = run / table / "rank=00000" / "seg-000000.parquet"
    damage(victim, how)
    kept = victim.read_bytes()
    proc = megascope("analyze", run, "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert victim.read_bytes() == kept  # skipped, never "repaired" or deleted
    report = json.loads(proc.stdout)
    assert [w for w in report["warnings"] if f"skipped damaged segment {table}/rank=00000/seg-000000.parquet" in w]
    assert report["findings"] == []  # a clean run stays clean: rank 0's missing steps are no slowdown
    # no readable segment before it: every step up to the next segment's first is incomplete
    last = 2 if table == "steps" else 3
    assert report["incomplete_data"] == [
        {"rank": 0, "steps": [0, last], "segment": f"{table}/rank=00000/seg-000000.parquet", "reason": "damaged"}]
    assert len(report["mfu"]["per_step"]) == STEPS


def test_truncated_segment_on_another_rank_is_incomplete_data_not_a_straggler(straggler, tmp_path):
    """Rank 1's events of steps 3-5 are lost. Before: its stage peer (rank 0) was reported as a
    straggler 10^9 times slower and stage 1 as imbalanced. Now: those rank-steps are left out and
    named, and the real straggler on the other stage is still found, the same as without damage."""
    run = copy(straggler, tmp_path)
    damage(run / "events" / "rank=00001" / "seg-000001.parquet", "truncated")
    proc = megascope("analyze", run, "--json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [STRAGGLER])]
    assert 1.2 < report["findings"][0]["severity"] < 1.4
    # steps 2 and 6 share segments with the lost one (a flush can split a step): left out too
    assert report["incomplete_data"] == [
        {"rank": 1, "steps": [2, 6], "segment": "events/rank=00001/seg-000001.parquet", "reason": "damaged"}]
    text = megascope("analyze", run)
    assert "Incomplete data" in text.stdout and "rank 1, steps 2-6: events/rank=00001/seg-000001.parquet" in text.stdout
    # the data layer: no detector can see them; their steps rows still count in the MFU timeline
    analysis = Run.open(run)
    rs = analysis.rank_steps()
    assert not ((rs["rank"] == 1) & rs.step.between(2, 6)).any() and len(rs) == 4 * STEPS - 5
    assert analysis.store.query("SELECT count(*) AS n FROM rank_step_incomplete").n.iloc[0] == 5
    clean_tps = Run.open(straggler).mfu().per_step.tokens_per_s
    assert (analysis.mfu().per_step.tokens_per_s - clean_tps).abs().max() < 1e-6 * clean_tps.max()
    heat = analysis.heatmap("compute")  # the persisted summary the dashboard reads: no value there
    row = heat.rows.index("1")
    assert all((heat.values[row, heat.cols.index(s)] != heat.values[row, heat.cols.index(s)]) for s in range(2, 7))


def test_lost_steps_segment_leaves_its_own_steps_out(straggler, tmp_path):
    """A steps segment holds whole rows: the steps between its neighbours' are the incomplete ones."""
    run = copy(straggler, tmp_path)
    damage(run / "steps" / "rank=00002" / "seg-000002.parquet", "empty")
    report = json.loads(megascope("analyze", run, "--json").stdout)
    assert report["incomplete_data"] == [{"rank": 2, "steps": [6, 8], "segment": "steps/rank=00002/seg-000002.parquet",
                                         "reason": "damaged"}]
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [STRAGGLER])]


# ---- analyze options -----------------------------------------------------------------------------
@pytest.mark.parametrize("value, needle", [("-1", "must be >= 1, got -1"), ("0", "must be >= 1, got 0"),
                                           ("x", "'x' is not an integer")])
def test_threads_must_be_positive(clean, tmp_path, value, needle):
    run = copy(clean, tmp_path)
    before = files_of(run)
    proc = megascope("analyze", run, "--threads", value)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"argument --threads: {needle}" in proc.stderr.strip().splitlines()[-1]
    assert files_of(run) == before  # refused before the run was opened


def test_text_report_slowest_step_skips_warm_up(clean, tmp_path):
    """Step 0 made 3x longer on every rank (compilation, allocator warm-up): it is not 'the slowest'."""
    run = copy(clean, tmp_path)
    _stretch_step0(run, table="steps")
    proc = megascope("analyze", run)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if "slowest step" in line)
    assert "slowest step (warm-up step 0 aside)" in line and "aside) 0:" not in line


def _stretch_step0(run: Path, table: str, factor: float = 3.0) -> None:
    """Step 0 of every rank lasts `factor` times longer: its steps rows start earlier (table 'steps')
    or its compute spans last longer (table 'events')."""
    for seg in sorted((run / table).glob("rank=*/seg-000000.parquet")):
        t = pq.read_table(seg)
        step0 = pc.equal(t["step"], 0)
        if table == "steps":
            span = pc.subtract(t["end_ns"], t["start_ns"])
            start = pc.if_else(step0, pc.subtract(t["start_ns"], pc.cast(pc.multiply(span, factor - 1), "int64")),
                               t["start_ns"])
            t = t.set_column(t.schema.get_field_index("start_ns"), "start_ns", start)
        else:
            hit = pc.and_(step0, pc.equal(t["kind"], "compute"))
            dur = pc.subtract(t["end_ns"], t["start_ns"])
            end = pc.if_else(hit, pc.add(t["start_ns"], pc.cast(pc.multiply(dur, factor), "int64")), t["end_ns"])
            t = t.set_column(t.schema.get_field_index("end_ns"), "end_ns", end)
        pq.write_table(t, seg)


def test_html_heatmaps_clip_the_warm_up_and_show_the_what_if_cost(straggler, tmp_path):
    run = copy(straggler, tmp_path)
    _stretch_step0(run, table="events", factor=6.0)
    page = tmp_path / "report.html"
    proc = megascope("analyze", run, "--html", page)
    assert proc.returncode == 0, proc.stderr
    html = page.read_text()
    assert "<th>throughput lost (what-if)</th>" in html
    report = json.loads(megascope("analyze", run, "--json").stdout)
    lost = report["findings"][0]["what_if"]["throughput_lost"]
    assert f"<td>{100 * lost:.1f}%</td>" in html
    # both heatmaps (compute, exposed_comm): the compute one is clipped below the warm-up's cells
    assert html.count("(outliers clipped)") >= 1
    compute = Run.open(run).heatmap("compute")
    zmax = json.loads(html.split('"zmax":', 1)[1].split(",", 1)[0])
    assert zmax < 0.5 * float(compute.values[:, 0].max())


# ---- export --------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needles", [
    (["--ranks", "99"], ["--ranks: rank(s) 99 are not in this run", "it has ranks 0-3"]),
    (["--ranks", "2,7-9"], ["rank(s) 7-9 are not in this run", "it has ranks 0-3"]),
    (["--steps", "100:200"], ["--steps 100:200 is outside the run", "it has steps 0-11"]),
    (["--steps", "5:2"], ["--steps: '5:2' is an empty window"]),
    (["--steps", "a:b"], ["--steps: 'a:b' is not A:B"]),
])
def test_export_outside_the_run_is_refused(clean, tmp_path, args, needles):
    out = tmp_path / "trace.json"
    assert_refused(megascope("export", clean, "--perfetto", out, *args), *needles)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_export_without_steps_picks_the_top_finding(straggler, tmp_path):
    out = tmp_path / "trace.json"
    proc = megascope("export", straggler, "--perfetto", out)
    assert proc.returncode == 0, proc.stderr
    assert "no --steps: exporting steps 2-3 around the top finding (straggler, rank 3, from step 2)" in proc.stderr
    spans = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == {2, 3}


def test_export_without_steps_or_findings_skips_the_warm_up(clean, tmp_path):
    proc = megascope("export", clean, "--perfetto", tmp_path / "t.json")
    assert proc.returncode == 0 and "exporting steps 1-2 after the warm-up step (no findings)" in proc.stderr


def test_color_scale_clips_a_whole_warm_up_column():
    """The demo's shape: 8 ranks x 30 steps, step 0 at 1.9 s on every rank against 0.3-0.4 s, a
    straggler at 0.6 s. The warm-up is 1/30 of the cells, more than the 2% a bare 98th percentile
    skips: the scale must still end near the straggler, not at the warm-up."""
    import numpy as np

    from megascope.analyzer.views.heatmap import color_range

    values = 0.3 + 0.1 * np.random.default_rng(0).random((8, 30))
    values[3, 8:] = 0.6
    values[:, 0] = 1.9
    zmin, zmax, clipped = color_range(values, higher_is_worse=True)
    assert clipped and 0.6 <= zmax < 0.7 and zmin == values.min()
    assert color_range(values[:, 1:], higher_is_worse=True) == (None, None, False)  # nothing to clip
