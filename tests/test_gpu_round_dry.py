"""benchmarks/gpu_round.sh on the CPU (DRY_RUN=1, tiny preset): the device round's plumbing, checked
where it costs nothing, so a lent GPU's few minutes are not lost to a broken script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_round_dry_run_completes_every_part(tmp_path: Path) -> None:
    out, runs = tmp_path / "out", tmp_path / "runs"
    env = dict(os.environ, DRY_RUN="1", PY=sys.executable, OUT=str(out), RUNS=str(runs))
    subprocess.run(["bash", "benchmarks/gpu_round.sh"], cwd=ROOT, env=env, check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = (out / "summary.md").read_text()
    ended = dict(re.findall(r"^=== (\S+): rc=(\d+)", summary, re.M))
    assert ended == {name: "0" for name in ("mfu", "mfu_mb8", "mfu_mb8_64", "mfu_cupti", "mfu_cupti_every4",
                                            "straggler", "report_variants", "straggler_report", "tracer_cost",
                                            "mfu_eager", "report_eager")}, summary
    assert all(f"| {name} |" in summary for name in ("mfu_mb8", "mfu_mb8_64", "mfu_cupti_every4"))  # one table
    assert "| kernels/step (CUPTI) |" in summary  # the device table (CPU: no NVML samples, no kernels)
    assert "| MFU (analyzer) |" in summary and "Step-time breakdown" in summary
    assert re.search(r"\| step time \(wall\) \| off \| on \| [\d.]+ \| [\d.]+ \| [\d.]+ \([\d.]+-[\d.]+\)", summary)
    assert "- straggler: " in summary  # the straggler run's findings line (a verdict on 2 busy cores is not judged)
    with tarfile.open(out / "runs.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("mfu/run.json") for n in names) and any(n.endswith("logs/straggler.log") for n in names)
