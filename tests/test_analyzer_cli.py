"""`megascope analyze` / `export` / `simulate` through the real command (subprocess)."""

import json
import subprocess
import sys

import pytest


def megascope(*args, check=False):
    return subprocess.run([sys.executable, "-m", "megascope", *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=check)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    megascope("simulate", out, "--dp", 2, "--tp", 2, "--pp", 2, "--steps", 12,
              "--inject", "straggler:rank=3,slowdown=0.1,from=4", check=True)
    return out


def test_analyze_json_contract(run_dir):
    res = megascope("analyze", run_dir, "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert {"run", "mfu", "findings", "warnings"} <= rep.keys()
    assert isinstance(rep["mfu"]["mean"], float) and len(rep["mfu"]["per_step"]) == 12
    assert {"step", "step_time_s", "tokens_per_s", "mfu"} <= rep["mfu"]["per_step"][0].keys()
    (f,) = rep["findings"]
    assert {"kind", "ranks", "hosts", "steps", "severity", "summary", "evidence"} <= f.keys()
    assert f["kind"] == "straggler" and f["ranks"] == [3] and f["steps"][0] == 4


def test_analyze_text_and_html(run_dir, tmp_path):
    res = megascope("analyze", run_dir, "--html", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr
    assert res.stdout.index("Findings") < res.stdout.index("MFU")
    assert "Rank 3" in res.stdout
    page = (tmp_path / "r.html").read_text()
    assert "<html" in page and "plotly" in page.lower() and "Rank 3" in page


def test_export_perfetto(run_dir, tmp_path):
    res = megascope("export", run_dir, "--perfetto", tmp_path / "t.json", "--steps", "5:6", "--ranks", "0-1,4-5")
    assert res.returncode == 0, res.stderr
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace if e["ph"] == "X"} == {0, 1, 4, 5}
    assert {e["args"]["step"] for e in trace if e["ph"] == "X"} == {5, 6}
    flows = [e for e in trace if e["ph"] in ("s", "f")]
    assert flows and {e["cat"] for e in flows} == {"p2p", "collective"}


def test_analyze_set_changes_a_threshold_and_the_report_records_it(run_dir):
    default = json.loads(megascope("analyze", run_dir, "--json", "--no-what-if", check=True).stdout)
    assert default["settings"]["detect"]["straggler"]["min_ratio"] == 1.03 and len(default["findings"]) == 1
    # the injected straggler is 1.1x its peers: a 1.5x bar lets it pass
    strict = json.loads(megascope("analyze", run_dir, "--json", "--no-what-if",
                                  "--set", "detect.straggler.min_ratio=1.5", check=True).stdout)
    assert strict["settings"]["detect"]["straggler"]["min_ratio"] == 1.5 and strict["findings"] == []


@pytest.mark.parametrize("args, needle", [
    (["analyze", "/nonexistent/run"], "does not exist"),
    (["analyze", ".", "--set", "detect.straggler.min_ratoi=1.05"], "no setting detect.straggler.min_ratoi; known"),
    (["analyze", ".", "--set", "detect.straggler.persist_steps=2.5"], "expected an integer"),
    (["analyze", ".", "--set", "detect.flap=1"], "a section, not a setting"),
    (["analyze", ".", "--set", "detect.warmup_factor=-1"], "finite number >= 0"),
    (["analyze", ".", "--set", "min_ratio"], "expected KEY=VALUE"),
    (["watch", ".", "--set", "detect.nope=1"], "no setting detect.nope"),
    (["analyze", "."], "not a megascope run directory"),
    (["export", "/nonexistent/run", "--perfetto", "x.json"], "does not exist"),
    (["simulate", "/tmp/x-megascope-bad", "--inject", "bogus:rank=1"], "unknown fault"),
])
def test_bad_input_is_a_message_not_a_traceback(args, needle):
    res = megascope(*args)
    assert res.returncode != 0 and needle in res.stderr and "Traceback" not in res.stderr
