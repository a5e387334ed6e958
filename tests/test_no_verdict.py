"""No events, no verdict (issue 31): a run with nothing traced says so instead of "Findings: none", and the
JSON report says how many rank-steps were judged; a traced run is judged on every rank-step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def megascope(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascope", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("trace", ["off", "on"])
def test_a_run_with_nothing_traced_gets_no_verdict(tmp_path: Path, trace: str) -> None:
    run = tmp_path / "run"
    proc = megascope("train", "--preset", "tiny", "--dp", "2", "--steps", "4", "--trace", trace, "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = megascope("analyze", str(run))
    report = json.loads(megascope("analyze", str(run), "--json", "--no-what-if").stdout)
    assert text.returncode == 0, text.stderr[-2000:]
    if trace == "off":
        assert "Findings: no verdict" in text.stdout and "Findings: none" not in text.stdout, text.stdout
        assert report["run"]["judged_rank_steps"] == 0
    else:
        assert "no verdict" not in text.stdout, text.stdout
        assert report["run"]["judged_rank_steps"] == 2 * 4  # every rank-step, warm-up included
