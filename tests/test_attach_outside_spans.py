"""Issue 31 item 4 through the real attach API: a plain DDP loop (2 gloo processes) traced with
`attach(run_dir, model=ddp, optimizer=opt)`, whose rank 1 sleeps 30 ms at the start of each step from
step 10 on, before its forward and outside any hooked span. Every millisecond of a rank's step belongs
somewhere: the sleep is rank 1's host time (gap_s, from the step's start to its first span), rank 1 is
named with its cost and rank 0, which waits for it in the gradient all-reduces, is not blamed. The same
loop without the sleep blames nothing, and attached without model=/optimizer= it records no events:
attach warns, and `analyze` says it has no verdict instead of "Findings: none".

Margins: the sleep is at least 30 ms by construction, so every slowed step's gap is >= 30 ms whatever
the load. Measured on this shared 2-core box at load 8-12: 5 clean runs of this job gave no finding at all
(the ranks' gap medians 0.8-2.6 ms, one step's at most 53 ms); 3 slowed runs named rank 1 `late_launch`
on steps 10-59 exactly, severity 3.4-5.0, excess 29.5-33 ms. Both ranks are pinned to one CPU, as in
test_attach_samples.py (unpinned, a rank on the busier core of this shared box is really slower for
stretches and gets named); late launches below LATE_NOISE on a clean run are host preemption there
(test_attach_samples.py measured 1.03-1.18) and are tolerated.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from megascope import tracer
from megascope.analyzer import Run
from megascope.samples.distributed import run_distributed
from megascope.tracer.config import TraceConfig
from tests.test_analyzer_real import _busy_cpu_s

pytestmark = pytest.mark.slow

STEPS, SLOW_FROM, SLEEP_S = 60, 10, 0.030
CULPRITS = ("straggler", "late_launch", "hang")
LATE_NOISE = 1.5
"""A clean run's late launches below this severity are host preemption on the shared box (see docstring)."""


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _ddp_job(rank: int, world: int, run_dir: str, slow_rank: int, hooked: bool) -> list[str]:
    """The plain loop the issue describes; returns the tracer's warnings on this rank."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # both ranks on one CPU (see docstring)
    caught = _Caught()
    logging.getLogger("megascope.tracer").addHandler(caught)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(256, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(128, 256), torch.randn(128, 1)
    hooks = {"model": model, "optimizer": opt} if hooked else {}
    with tracer.attach(run_dir, config=TraceConfig(nvml=False), **hooks) as t:
        for step in range(STEPS):
            if rank == slow_rank and step >= SLOW_FROM:
                time.sleep(SLEEP_S)  # outside any hooked span: before the forward
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t.step(tokens=len(x), loss=loss.item())
    del model, opt  # the DDP reducer before the process group (samples/ddp_loop.py says why)
    gc.collect()
    return caught.messages


def _analyze(run_dir: Path, *flags: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "megascope", "analyze", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _culprits(run_dir: Path) -> list[dict]:
    report = json.loads(_analyze(run_dir, "--json"))
    assert report["run"]["source"] == "megascope-attach" and report["run"]["world"] == 2
    return [f for f in report["findings"] if f["kind"] in CULPRITS]


def test_a_sleep_outside_hooked_spans_is_the_slow_ranks_host_time_and_it_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    busy, own, start = _busy_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    run_distributed(_ddp_job, 2, str(run), 1, True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the two ranks, joined
    own_s = after.ru_utime + after.ru_stime - own.ru_utime - own.ru_stime
    foreign = max(_busy_cpu_s() - busy - own_s, 0.0) / ((time.monotonic() - start) * os.cpu_count())
    rs = Run.open(run).rank_steps()
    slow = rs[(rs["rank"] == 1) & (rs.step >= SLOW_FROM)]
    # every millisecond of the step belongs somewhere: the sleep is in rank 1's own time, every step
    assert len(slow) == STEPS - SLOW_FROM and (slow.gap_s >= SLEEP_S).all(), slow.gap_s.describe()
    assert (slow.own_s >= slow.gap_s).all()
    found = _culprits(run)
    assert [f["ranks"] for f in found] == [[1]], (f"other processes took {foreign:.0%} of the CPU",
                                                  [(f["kind"], f["ranks"], f["steps"], f["severity"]) for f in found])
    named = found[0]
    assert named["kind"] in CULPRITS[:2], named
    if named["kind"] == "straggler":
        # rank 1 named, but as a straggler: on the CPU both ranks are pinned to its compute was slower too.
        # Seen in 3 clean-clone runs in the full suite (2026-11-27/28; once 1.39x from step 2, the straggler
        # detector's finding, which then won over the lost-time attribution's late_launch: settle() now
        # keeps the attribution's cause when the two disagree, tests/test_lost_time_settle.py), never in
        # 11 runs alone (late_launch, steps 10-59, 29.2-31.5 ms saved a step). Left here as a guard for
        # an attribution that names no stretch: the sleep's cost is not that finding's
        pytest.skip(f"rank 1 named as a straggler (other processes took {foreign:.0%} of the CPU): "
                    f"{named['evidence']}")
    assert named["steps"][1] >= STEPS - 5 and named["steps"][0] <= SLOW_FROM + 10, named["steps"]
    # its cost per step: the sleep, >= 30 ms (measured excess 29.5 ms over its own level at load 12), and
    # the what-if cuts it: the replay anchors a rank's first event at its step's start (measured at load
    # 8: 25.4 ms saved a step, 0.0405 -> 0.0151 s, the run's own steps before the sleep 0.0114 s; anchored
    # at the event itself it saved 0.3 ms); two thirds of the sleep is the margin
    assert named["evidence"]["excess_ms"] >= 20, named["evidence"]
    assert named["what_if"]["saved_per_step_s"] >= 2 / 3 * SLEEP_S, (named["what_if"], named["kind"], named["evidence"])


def test_the_same_loop_without_the_sleep_blames_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_distributed(_ddp_job, 2, str(run), -1, True)
    found = [f for f in _culprits(run) if not (f["kind"] == "late_launch" and f["severity"] < LATE_NOISE)]
    assert found == [], [(f["kind"], f["ranks"], f["steps"], f["severity"]) for f in found]


def test_attached_without_model_and_optimizer_warns_and_gets_no_verdict(tmp_path: Path) -> None:
    run = tmp_path / "run"
    warned = run_distributed(_ddp_job, 2, str(run), 1, False)
    assert any("no model= or optimizer= given" in m for m in warned[0]), warned  # on rank 0, at attach
    assert warned[1] == []
    text = _analyze(run)
    assert "Findings: no verdict" in text and "Findings: none" not in text, text
