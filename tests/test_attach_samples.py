"""Jobs megascope did not write, traced by attaching and judged by `megascope analyze --json`: the
DDP and FSDP2 samples (2 gloo ranks under torchrun), clean and with a slow rank (shown in the
dashboard's overview and heatmap for DDP), and the plain loop.

Both ranks are pinned to one CPU. On this shared 2-core machine (load 8-19 from other jobs while
these were measured) a rank on the busier core is really slower for stretches of steps, and the
analyzer rightly says so: unpinned, 2 of 4 clean DDP runs gave a finding (a 9-step straggler, a late
launch); pinned together, both ranks meet the same co-tenants, and 0 of 8 clean runs did.
The slow rank sleeps 100 ms in each forward from step 8. Measured on clean pinned runs, the per-step
log ratio of the two ranks' forward+backward time has a standard deviation of 0.17-0.31 (0.23 over
the run); a 100 ms sleep on ~45 ms of contended work shifts it by 1.7-2.1 (6 sigma or more), where
40 ms shifted it by only 0.33-1.12 (the sleeping rank frees the shared core for its peer) and was
found in 1 of 3 runs.
Pinned clean runs still see co-tenants preempt one rank now and then: in 1 of 6 clean DDP runs (load
7-14) rank 1 paused 2-6 ms on 4 of 22 steps (between forward and backward, before the optimizer),
and the analyzer reported a late launch of severity 1.09 (own time 9% above its peer's); the late
launches it reported beside true stragglers were 1.03-1.18, the stragglers themselves 4-8. A
clean run may therefore show a late launch below severity LATE_NOISE, and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SLOW = ["--slow-rank", "1", "--slow-ms", "100", "--slow-from", "8"]
LATE_NOISE = 1.5
"""Late launches below this severity are host preemption on the shared machine (measured 1.03-1.18)."""


def _one_cpu() -> None:
    """Runs in the child before exec: torchrun and its ranks inherit one CPU."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


def _torchrun(sample: str, run_dir: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "samples" / sample), "--run-dir", str(run_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=_one_cpu)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _analyze(run_dir: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(run_dir), "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["run"]["source"] == "megascope-attach" and report["run"]["world"] == 2
    return report["findings"]


DASHBOARD = """
import json, sys
import numpy as np
from megascope.dashboard.app import create_app
app = create_app([sys.argv[1]])
from megascope.dashboard.pages import heatmap, overview
with app.server.test_request_context():
    _, _, figure, findings, _ = overview.refresh(0, 0)
    compute = heatmap.update_heatmap("compute", "rank", "rank", 0, 0)
def text(c):
    if isinstance(c, (str, int, float)):
        return str(c)
    if isinstance(c, (list, tuple)):
        return " ".join(text(x) for x in c)
    return "" if c is None else text(getattr(c, "children", None))
z = np.asarray(compute.data[0].z, dtype=float)
print(json.dumps({"steps": len(figure.data[0].x), "findings": text(findings),
                  "rows": [str(y) for y in compute.data[0].y], "mean_from_10": np.nanmean(z[:, 10:], axis=1).tolist()}))
"""
"""The dashboard's own page callbacks on a run (a fresh process: Dash registers its pages once)."""


def _dashboard(run_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", DASHBOARD, str(run_dir)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("sample", ["ddp_loop.py", "fsdp2_loop.py"])
def test_clean_run_has_no_findings(tmp_path, sample):
    _torchrun(sample, tmp_path / "run")
    found = _analyze(tmp_path / "run")
    real = [f for f in found if not (f["kind"] == "late_launch" and f["severity"] < LATE_NOISE)]
    assert real == [], [(f["kind"], f["ranks"], f["steps"], f["severity"], f["summary"]) for f in found]


@pytest.mark.parametrize("sample", ["ddp_loop.py", "fsdp2_loop.py"])
def test_slow_rank_is_named_the_straggler(tmp_path, sample):
    _torchrun(sample, tmp_path / "run", *SLOW)
    found = _analyze(tmp_path / "run")
    stragglers = [f for f in found if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[1]], \
        [(f["kind"], f["ranks"], f["steps"], f["severity"]) for f in found]
    assert 6 <= stragglers[0]["steps"][0] <= 9  # slowed from step 8
    if sample == "ddp_loop.py":  # and the dashboard shows it: overview finding, heatmap row
        shown = _dashboard(tmp_path / "run")
        assert shown["steps"] == 24 and "straggler" in shown["findings"] and shown["rows"] == ["0", "1"]
        assert shown["mean_from_10"][1] > shown["mean_from_10"][0]


def test_plain_loop_run_is_analyzable(tmp_path):
    _torchrun("plain_loop.py", tmp_path / "run", "--steps", "12")
    _analyze(tmp_path / "run")  # run.json has a topology: analyze reads it (it refused it before)
