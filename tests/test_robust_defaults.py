"""Robust by default: a plain `megascope train` checkpoints on a time cadence and restarts after a rank
dies, with no robust flag given; the time cadence becomes one step count on every rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megascope.trainer.config import JobConfig, RobustConfig
from megascope.trainer.launch import recovery_text
from megascope.trainer.robust.checkpoint import latest_complete
from megascope.trainer.robust.checkpoint_cadence import PROBE_STEPS, CheckpointCadence, steps_for_interval
from megascope.trainer.robust.heartbeat import read_heartbeats


def test_defaults_recover():
    r = RobustConfig()
    assert r.checkpoint_every == -1 and r.checkpoint_interval_s > 0 and r.max_restarts >= 1
    text = recovery_text(JobConfig())
    assert "a checkpoint every ~60 s of training" in text and "up to 3 automatic restart(s)" in text
    off = JobConfig()
    off.robust.checkpoint_every, off.robust.max_restarts = 0, 0
    assert recovery_text(off).startswith("off (no checkpoints, no automatic restart")


def test_steps_for_interval():
    assert steps_for_interval(60, 0.046) == 1304
    assert steps_for_interval(60, 120) == 1  # a step longer than the interval: every step
    assert steps_for_interval(60, 0) == 1


def test_time_cadence_skips_the_warmup_step_and_agrees_once():
    agreed: list[float] = []

    def agree(median: float) -> float:
        agreed.append(median)
        return 2 * median  # another rank was twice as slow: its median wins

    cadence = CheckpointCadence(RobustConfig(checkpoint_interval_s=1.0), start_step=10, agree=agree)
    due = [cadence.due(step, 5.0 if step == 10 else 0.05) for step in range(10, 40)]
    assert agreed == [0.05]  # the slow first step of the attempt is not in the median
    assert cadence.fixed_at == 10 + PROBE_STEPS and cadence.every == 10  # 1 s / (2 * 0.05 s)
    assert [10 + i for i, d in enumerate(due) if d] == [19, 29, 39]
    assert "every 10 steps" in cadence.describe()


def test_step_cadence_and_off_never_agree():
    def never(_: float) -> float:
        raise AssertionError("no collective for a step cadence")

    every3 = CheckpointCadence(RobustConfig(checkpoint_every=3), 0, never)
    assert [s for s in range(10) if every3.due(s, 0.1)] == [2, 5, 8]
    off = CheckpointCadence(RobustConfig(checkpoint_every=0), 0, never)
    assert not any(off.due(s, 0.1) for s in range(10))


@pytest.mark.slow
def test_a_plain_run_survives_a_killed_rank(tmp_path):
    """No --checkpoint-every, no --max-restarts: only the cadence is made short so that a checkpoint
    exists within seconds (the default is ~60 s of training); late launches slow the steps so the
    kill lands mid-run."""
    cmd = [sys.executable, "-m", "megascope", "train", "--preset", "tiny", "--dp", "2", "--pp", "2",
           "--steps", "60", "--run-dir", str(tmp_path), "--set", "robust.checkpoint_interval_s=0.5",
           "--inject", "late_launch:rank=0,ms=60"]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            ckpt, beat = latest_complete(tmp_path), read_heartbeats(tmp_path).get(2, {})
            # ckpt.step is the step a resume starts at; rank 2 at that step or later is training past the
            # checkpoint. (With `>`, a checkpoint every step and heartbeats a beat behind, the condition
            # could stay false for the whole run: seen once in CI.)
            if ckpt is not None and beat.get("step", -1) >= ckpt.step:
                break
            assert time.monotonic() < deadline and driver.poll() is None, "no checkpoint before the end"
            time.sleep(0.05)
        os.kill(int(beat["pid"]), signal.SIGKILL)
        out, err = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, err[-3000:]
    assert "recovery: a checkpoint every ~0.5 s of training, up to 3 automatic restart(s)" in out
    resumed = re.findall(r"resumed from checkpoint step (\d+)", out)
    assert len(resumed) == 1 and int(resumed[0]) > 0, out[-3000:]
    assert f"done: {60 - int(resumed[0])} steps" in out  # the restarted attempt ran the rest
