"""The `--json` report is a versioned contract: every report, with findings of every kind, validates
against docs/report.schema.json, and the schema does reject reports that break it."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import duckdb
import jsonschema
import numpy as np
import pandas as pd
import pytest

from megascope.analyzer import Run, build_report
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.workload_imbalance import WorkloadImbalanceDetector
from megascope.analyzer.findings import KINDS
from megascope.analyzer.report.build import SCHEMA_VERSION, json_safe

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

# one simulated run per finding kind the simulator can inject (workload imbalance: below)
CASES = {
    # the late launch must cost something beside the straggler: at 15 ms its fix saved nothing (the ranks
    # waited for the straggler anyway) and it went as a victim (graph/what_if_victims.py); 60 ms saves 20 ms
    "straggler+late_launch": (dict(dp=4, tp=2, pp=2, steps=20), ["straggler:rank=13,slowdown=0.2,from=6",
                                                                  "late_launch:rank=5,ms=60,every=2,from=4"]),
    "network_flap": (dict(dp=2, tp=1, pp=4, steps=20), ["flap:ranks=1-3,down_ms=20,period_steps=6,len=2"]),
    "slow_link": (dict(dp=2, tp=1, pp=4, steps=20), ["slow_link:ranks=1-3,factor=3"]),
    "stage_imbalance": (dict(dp=2, tp=2, pp=2, steps=20), ["imbalance:stage=1,slowdown=0.2"]),
    "hang": (dict(dp=2, tp=2, pp=2, steps=12), ["hang:rank=5,at=6"]),
    "host-wide straggler": (dict(dp=8, tp=2, pp=2, steps=16), ["straggler:ranks=8-15,slowdown=0.2,from=3"]),
}
EXPECTED = {"straggler+late_launch": {"straggler", "late_launch"}, "network_flap": {"network_flap"},
            "slow_link": {"slow_link"}, "stage_imbalance": {"stage_imbalance"}, "hang": {"hang"},
            "host-wide straggler": {"straggler"}}
"""The kinds each run must report (which ranks is the detection tests' business)."""


def errors(instance, schema=None) -> list[str]:
    validator = VALIDATOR if schema is None else jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(instance)]


def test_schema_is_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert set(SCHEMA["$defs"]["finding"]["properties"]["kind"]["enum"]) == set(KINDS)


@pytest.fixture(scope="module")
def reports(simulated_run) -> dict[str, dict]:
    out = {}
    for name, (layout, inject) in CASES.items():
        run = simulated_run(**layout, inject=inject)
        out[name] = json_safe(build_report(Run.open(run)))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_report_of_each_finding_kind_validates(reports, name):
    report = reports[name]
    assert {f["kind"] for f in report["findings"]} == EXPECTED[name]
    assert errors(report) == []


def test_cli_json_report_validates(reports, simulated_run):
    """What the command prints (not only what build_report returns), what-if skipped too."""
    run = simulated_run(dp=2, tp=2, pp=2, steps=12, inject=["straggler:rank=3,slowdown=0.3,from=4"])
    for extra in ([], ["--no-what-if"]):
        proc = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(run), "--json", *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert report["schema_version"] == SCHEMA_VERSION and report["findings"]
        assert errors(report) == []
        assert ("what_if" in report["findings"][0]) is (not extra)


def test_workload_imbalance_finding_validates():
    """The simulator cannot make one: the detector on a rank_step table with a replica slow at random."""
    rng = np.random.default_rng(1)
    factors = np.exp(rng.normal(0, 0.12, size=(20, 4)))
    rows = [((s * 4 + d) * 2 + t, step, s, d, 0.1 * factors[step, d] * np.exp(rng.normal(0, 0.005)), 0.5)
            for step in range(20) for s in range(2) for d in range(4) for t in range(2)]
    table = pd.DataFrame(rows, columns=["rank", "step", "pp", "dp", "work_s", "step_time_s"])
    table = table.assign(tp=0, forward_s=table.work_s, backward_s=0.0)  # work_s = forward_s + backward_s

    class Store:  # the detector's queries run on a real DuckDB rank_step table
        topology = table[["rank", "pp", "dp"]].drop_duplicates().assign(host="h0")
        con = duckdb.connect()
        con.register("rank_step", table)

        def run_with_retry(self, action):
            return action()

        def arrow(self, sql, params=None):
            return self.con.sql(sql, params=params or {}).to_arrow_table()

    (finding,) = WorkloadImbalanceDetector().detect(DetectContext(Store()))
    finding_schema = {**SCHEMA, "$ref": "#/$defs/finding"}
    for key in ("type", "required", "additionalProperties", "properties"):
        finding_schema.pop(key)
    assert errors(json_safe(finding.to_dict()), finding_schema) == []


def test_schema_rejects_broken_reports(reports):
    """The check can fail: each of these edits breaks the contract."""
    good = reports["straggler+late_launch"]
    edits = {
        "no schema_version": lambda r: r.pop("schema_version"),
        "another version": lambda r: r.update(schema_version=2),
        "unknown top-level key": lambda r: r.update(extra=1),
        "unknown kind": lambda r: r["findings"][0].update(kind="slowness"),
        "straggler evidence without its ratio": lambda r: r["findings"][0]["evidence"].pop("compute_ratio_vs_stage"),
        "steps not a pair": lambda r: r["findings"][0].update(steps=[6]),
        "what-if lost > 100%": lambda r: r["findings"][0]["what_if"].update(throughput_lost=1.5),
        "incomplete data without steps": lambda r: r["incomplete_data"].append({"rank": 1, "segment": "x"}),
        "per-step MFU as text": lambda r: r["mfu"]["per_step"][0].update(mfu="35%"),
    }
    for what, edit in edits.items():
        broken = copy.deepcopy(good)
        edit(broken)
        assert errors(broken), what
