"""`megascope diff RUN_A RUN_B` (analyzer/views/run_diff.py): what changed between two runs.

Real trainer runs (slow: three short `megascope train --pp 2` runs): a run with a straggler injected on
rank 1 (stage 1) against a clean one names backward on stage 1, up by about the injected amount, with
rank 1's own time moved most and its finding appeared; two clean runs name nothing. Simulated runs
(fast): a stage made slower by the simulator is named on its stage, two clean seeds name nothing, runs
of different layouts compare their phases and say what they do not share. Imported real traces (the
OSDI'25 what-if artifact, /work/shared/whatif-traces, where present): a trace against itself names
nothing, traces of other layouts compare what they share. The CLI: text, --json, one line on a missing
run; the dashboard's compare page shows the named changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megascope.analyzer import Run
from megascope.analyzer.views.run_diff import RunDiff, diff, finding_text
from megascope.cli import main
from megascope.tracer.run_dir import write_manifest
from tests.test_analyzer_real import FOREIGN_SHARE_MAX, train_measuring_load

LAYOUT = ["--pp", "2"]
"""Two ranks, one a stage: on a 2-core box, dp 2 x pp 2 puts 4 ranks on 2 cores, and which ranks share a
core moves a rank's own time by 40-60% between clean runs (measured: docs/diff.md)."""
STEPS = 16
SLOW_RANK, SLOW_STAGE, SLOWDOWN, FROM = 1, 1, 3.0, 2
WHATIF = Path("/work/shared/whatif-traces")


def _sentences(d: RunDiff) -> list[str]:
    return [c.sentence() for c in d.named]


# ---- real trainer runs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[Run, float]]:
    """Two clean runs and one with rank 1 slowed from step 2, each with the share of the CPU that other
    processes took while it ran (test_analyzer_real.train_measuring_load)."""
    root = tmp_path_factory.mktemp("diff-real")
    return {"clean": train_measuring_load(root / "clean", LAYOUT, STEPS),
            "slow": train_measuring_load(root / "slow", LAYOUT, STEPS,
                                         f"straggler:rank={SLOW_RANK},slowdown={SLOWDOWN:g},from={FROM}"),
            "clean2": train_measuring_load(root / "clean2", LAYOUT, STEPS)}


def _busy(*runs: tuple[Run, float]) -> float:
    return max(foreign for _, foreign in runs)


@pytest.mark.slow
def test_real_straggler_is_named_on_its_stage_and_rank(trained):
    clean, slow = trained["clean"][0], trained["slow"][0]
    d = diff(clean, slow)
    backward = next(c for c in d.stages if (c.measure, c.scope) == ("backward", f"stage {SLOW_STAGE}"))
    busy = _busy(trained["clean"], trained["slow"])
    if not backward.named and busy > FOREIGN_SHARE_MAX:
        pytest.skip(f"other processes took {busy:.0%} of the CPU (> {FOREIGN_SHARE_MAX:.0%}): not judged; "
                    f"{backward.to_dict()}")
    assert backward.named and backward.delta > 0, (backward.to_dict(), _sentences(d))
    assert d.ranks[0].scope == f"rank {SLOW_RANK}" and d.ranks[0].delta > 0, _sentences(d)
    assert d.step_time.delta > 0 and d.mfu is not None and d.mfu.delta < 0
    # the findings that appeared are run B's that run A has not: the diff's contract, judged against the
    # analyzer's own findings (whether the analyzer names this straggler is test_analyzer_real's to judge;
    # one rank a stage, it says stage imbalance: 5 of 5 runs here, and CI's run of fb59a6b named none)
    keys_a = {(f.kind, tuple(f.ranks)) for f in clean.findings()}
    expected = [(f.kind, list(f.ranks)) for f in slow.findings() if (f.kind, tuple(f.ranks)) not in keys_a]
    assert [(f["kind"], f["ranks"]) for f in d.appeared] == expected, (d.appeared, expected)
    # the size: the fault sleeps (slowdown - 1) x the backward it stretches, so (slowdown - 1) / slowdown of
    # the slowed run's backward is the sleep; the change is that minus any change of the backward itself,
    # judged within the change's own threshold (3x the runs' noise)
    rs = slow.rank_steps()
    stretched = rs[(rs["rank"] == SLOW_RANK) & (rs.step >= FROM)].backward_s.median()
    injected = (SLOWDOWN - 1) / SLOWDOWN * float(stretched)
    assert abs(backward.delta - injected) <= backward.threshold, (backward.to_dict(), injected)


@pytest.mark.slow
def test_real_clean_runs_name_nothing(trained):
    d = diff(trained["clean"][0], trained["clean2"][0])
    busy = _busy(trained["clean"], trained["clean2"])
    if d.named and busy > FOREIGN_SHARE_MAX:
        pytest.skip(f"other processes took {busy:.0%} of the CPU during a clean run (> {FOREIGN_SHARE_MAX:.0%}): "
                    f"not clean; named {_sentences(d)}")
    assert d.named == [], [c.to_dict() for c in d.named]
    assert d.not_compared == [] and len(d.stages) > 10 and len(d.ranks) == 2


@pytest.mark.slow
def test_real_diff_cli_json_and_text(trained, capsys):
    clean, slow = trained["clean"][0].path, trained["slow"][0].path
    assert main(["diff", str(clean), str(slow), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"][0]["scope"] == f"rank {SLOW_RANK}" and out["ranks"][0]["delta"] > 0
    backward = next(c for c in out["stages"] if (c["measure"], c["scope"]) == ("backward", f"stage {SLOW_STAGE}"))
    assert (backward["sentence"] in out["named"]) == backward["named"]
    assert main(["diff", str(clean), str(slow)]) == 0
    text = capsys.readouterr().out
    assert f"run A: {clean}" in text and f"run B: {slow}" in text
    appeared = text.split("Findings that appeared in run B:")[1].split("Findings that went away")[0]
    assert [line.strip() for line in appeared.strip().splitlines()] == (
        [finding_text(f) for f in out["findings_appeared"]] or ["none"]), appeared


# ---- simulated runs (fast) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def simulated(simulated_run) -> dict[str, Run]:
    """dp 2 x pp 2 clean (two seeds), the same with stage 1 30% slower, and a dp 2 x pp 4 x tp 2 run."""
    base = dict(dp=2, tp=1, pp=2, steps=20)
    return {"a": Run.open(simulated_run(**base, seed=0)), "a2": Run.open(simulated_run(**base, seed=1)),
            "slow": Run.open(simulated_run(**base, seed=2, inject=["imbalance:stage=1,slowdown=1.3"])),
            "other": Run.open(simulated_run(dp=2, tp=2, pp=4, steps=20, seed=3))}


def test_slower_stage_is_named_with_its_size(simulated):
    d = diff(simulated["a"], simulated["slow"])
    stage = {(c.measure, c.scope): c for c in d.stages}
    for phase in ("forward", "backward"):
        change = stage[(phase, "stage 1")]
        assert change.named and abs(change.relative - 0.3) < 0.05, change.to_dict()
        assert not stage[(phase, "stage 0")].named, stage[(phase, "stage 0")].to_dict()
    assert d.step_time.named and d.step_time.delta > 0
    assert "backward on stage 1 +" in " ".join(_sentences(d))
    assert [f["kind"] for f in d.appeared] == ["stage_imbalance"] and d.went_away == []


def test_clean_simulated_runs_name_nothing(simulated):
    d = diff(simulated["a"], simulated["a2"])
    assert d.named == [], [c.to_dict() for c in d.named]


def test_the_same_run_twice_is_no_change(simulated):
    d = diff(simulated["a"], simulated["a"])
    assert d.named == [] and all(c.delta == 0 for c in d.stages + d.phases + d.ranks)
    assert d.appeared == [] == d.went_away and d.not_compared == []


def test_different_layouts_compare_phases_only(simulated):
    d = diff(simulated["a"], simulated["other"])
    assert d.stages == [] and d.ranks == []
    assert {"forward", "backward", "pipeline wait"} <= {c.measure for c in d.phases}
    notes = " | ".join(d.not_compared)
    assert "dp 2 x pp 2 x tp 1 vs dp 2 x pp 4 x tp 2" in notes and "stages not compared" in notes
    assert "only in run B: tp all_reduce" in notes and "findings matched by kind only" in notes


def test_cli_bad_input_is_one_line(simulated, capsys, tmp_path):
    assert main(["diff", str(simulated["a"].path), "/nonexistent/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megascope diff: ") and "/nonexistent/run" in err and len(err.splitlines()) == 1
    empty = tmp_path / "empty"  # a job that started (run.json) but finished no step
    write_manifest(empty, {k: v for k, v in simulated["a"].manifest.items() if k != "schema_version"})
    assert main(["diff", str(empty), str(simulated["a"].path)]) == 2
    assert capsys.readouterr().err.strip() == f"megascope diff: {empty} has no complete step: nothing to compare"
    proc = subprocess.run([sys.executable, "-m", "megascope", "diff", str(simulated["a"].path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "RUN_B" in proc.stderr and "Traceback" not in proc.stderr


def test_dashboard_compare_page_shows_the_named_changes(simulated):
    from megascope.dashboard.app import create_app
    from tests.dash_text import dash_text

    app = create_app([str(simulated["a"].path), str(simulated["slow"].path)])
    from megascope.dashboard.pages import compare
    with app.server.test_request_context():
        _, _, summary, _ = compare.update_comparison(0)
    shown = dash_text(summary)
    assert "backward on stage 1 +" in shown and "appeared: stage_imbalance" in shown, shown


# ---- imported real traces --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Run]:
    if not (WHATIF / "trace-ST.parquet").exists():
        pytest.skip(f"the published what-if traces are not here ({WHATIF})")
    root = tmp_path_factory.mktemp("diff-imported")
    for name in ("ST", "SE", "AR"):
        assert main(["import", "ndtimeline", str(WHATIF / f"trace-{name}.parquet"), "--meta",
                     str(WHATIF / f"meta-{name}.yaml"), "--out", str(root / name)]) == 0
    return {name: Run.open(root / name) for name in ("ST", "SE", "AR")}


def test_imported_trace_against_itself(imported):
    d = diff(imported["ST"], imported["ST"])
    assert d.named == [] and d.mfu is None and len(d.stages) > 20
    assert d.not_compared == ["MFU not compared: a run has no peak FLOP/s in run.json (an imported trace)"]


def test_imported_traces_of_other_layouts(imported):
    se = diff(imported["ST"], imported["SE"])  # pp 4 vs pp 2: job-wide phases only
    assert se.stages == [] and se.ranks == [] and len(se.phases) >= 10
    assert any("pp differs" in n for n in se.not_compared)
    ar = diff(imported["ST"], imported["AR"])  # pp 4 both: per stage too, but ranks mean other things
    assert {c.scope for c in ar.stages} == {"stage 0", "stage 1", "stage 2", "stage 3"} and ar.ranks == []
    assert any("ranks not compared" in n for n in ar.not_compared)
