"""The what-if against the What-if paper's own table (OSDI'25, "Understanding Stragglers in Large Model
Training Using What-if Analysis"): its three published traces of real jobs (shared/whatif-traces/,
README there), imported with the real `megascope import ndtimeline`, analyzed with the default
detectors, and the what-if of the finding that blames what the paper blames set beside the paper's
t_rem / t_ori (mw-AR.json for AR's worker, ms-ST.json and ms-SE.json for the last stage).

    python benchmarks/what_if_paper.py [--traces DIR] [--json]

Nothing from the answer files reaches the analysis: they are read here only to print the paper's
figures. Also printed: every finding of each trace (AR: one worker alone; SE: no late launch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from megascope.analyzer import Run
from megascope.analyzer.findings import Finding
from megascope.cli import main as megascope

TRACES = Path(__file__).resolve().parents[2] / "shared" / "whatif-traces"
# trace -> (the paper's answer file, what it blames: the finding kind that names it)
BLAMED = {"AR": ("mw-AR.json", "straggler"), "ST": ("ms-ST.json", "stage_imbalance"),
          "SE": ("ms-SE.json", "stage_imbalance")}


def blamed(findings: list[Finding], kind: str, last_stage: int) -> Finding | None:
    """The finding naming what the paper fixes: AR's slow worker (a straggler), ST's and SE's last stage."""
    for f in findings:
        if f.kind == kind and (kind != "stage_imbalance" or f.evidence.get("stage") == last_stage):
            return f
    return None


def one_trace(name: str, traces: Path, work: Path) -> dict:
    out = work / name
    code = megascope(["import", "ndtimeline", str(traces / f"trace-{name}.parquet"), "--meta",
                      str(traces / f"meta-{name}.yaml"), "--out", str(out)])
    if code != 0:
        raise SystemExit(f"what_if_paper: importing {name} failed (exit {code})")
    run = Run.open(out)
    findings = run.findings()
    answer_file, kind = BLAMED[name]
    paper = json.loads((traces / answer_file).read_text())
    f = blamed(findings, kind, int(run.manifest["topology"]["pp"]) - 1)
    wi = run.what_if(f) if f is not None else {}
    ours = wi["what_if_step_time_s"] / wi["step_time_s"] if wi.get("applicable") else None
    return {"trace": name, "blamed": kind, "ranks": f.ranks if f else [], "ours": ours,
            "paper": paper["trem"] / paper["tori"], "steps_sampled": wi.get("steps_sampled", []),
            "findings": [{"kind": g.kind, "ranks": g.ranks[:8]} for g in findings]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--traces", type=Path, default=TRACES, help="folder of the artifact's trace-*.parquet")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args()
    if not (args.traces / "trace-AR.parquet").is_file():
        print(f"what_if_paper: no trace-AR.parquet in {args.traces}; pass --traces DIR", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="megascope-whatif-paper-") as tmp:
        rows = [one_trace(name, args.traces, Path(tmp)) for name in BLAMED]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'trace':6} {'blamed':16} {'t_rem/t_ori ours':>17} {'paper':>7} {'diff':>7}  findings")
    for r in rows:
        ours = f"{r['ours']:.3f}" if r["ours"] is not None else "n/a"
        diff = f"{r['ours'] - r['paper']:+.3f}" if r["ours"] is not None else ""
        names = ", ".join(f"{g['kind']} {g['ranks'][:4]}" for g in r["findings"])
        print(f"{r['trace']:6} {r['blamed']:16} {ours:>17} {r['paper']:7.3f} {diff:>7}  {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
