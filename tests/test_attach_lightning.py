"""A PyTorch Lightning job (samples/lightning_loop.py, 2 gloo ranks under torchrun, Lightning's DDP
strategy) traced through megascope.tracer.lightning_callback and judged by `megascope analyze --json`:
clean, and with rank 1 slowed from outside the process: the test finds rank 1's pid under torchrun by
its environment and, when the job's own log shows megascope's summary line for steps 0-49
(trace.summary_every's default 50: tracer/step_summary.py, printed by the attached tracer), stops it
with SIGSTOP for 15 ms of every 20 ms until the job ends (tests/outside_faults.py).
The clean stretch matters: slowed from step 0-3, rank 1's forward+backward took 2-10x rank 0's on
nearly every step and nothing was found (2 of 3 runs), since the straggler detector judges flagged
steps against the run's own flag rate and a rank's level before the onset. So does a steady
slowdown: stopped 50 of every 100 ms, a step's slowdown depended on where the stops fell (rank 1's
forward+backward 1-9x rank 0's, step to step) and runs gave nothing, a 9-step straggler or a late
launch; 10 of 20 ms gave ~2x (1.5-3x step to step), named in 3 of 3 runs and then in 0 of 2 on a
busier box (load 6); 15 of 20 ms, 3-5x, from step 16-20 was named in 3 of 3 runs at load 6
(severity 2.4-3.2). A CPU hog beside rank 1 with rank 0 moved to the other CPU gave 0 of 3 (once
rank 0 named: the two CPUs see other processes' load differently). Skipped without the optional extra
`megascope[attach]` (lightning). Pinned to one CPU and judged as the DDP and FSDP2 samples are
(tests/test_attach_samples.py says why and what was measured).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("lightning")

from tests.outside_faults import StopDutyCycle, worker_pid  # noqa: E402
from tests.test_attach_outside_spans import CULPRITS  # noqa: E402
from tests.test_attach_samples import LATE_NOISE, ROOT, _analyze, _one_cpu, _torchrun  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = "100"
CLEAN = "[megascope] steps 0-49 | step time (s) min "
"""The job's summary line after its clean stretch: rank 1 is slowed from here on (steps 50-99)."""


def test_lightning_clean_run_has_no_findings(tmp_path):
    _torchrun("lightning_loop.py", tmp_path / "run", "--steps", STEPS)
    found = _analyze(tmp_path / "run")
    real = [f for f in found if not (f["kind"] == "late_launch" and f["severity"] < LATE_NOISE)]
    assert real == [], [(f["kind"], f["ranks"], f["steps"], f["severity"], f["summary"]) for f in found]


def test_lightning_rank_stopped_from_outside_is_named(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "samples" / "lightning_loop.py"), "--run-dir", str(run), "--steps", STEPS]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_one_cpu)
    assert job.stdout is not None
    try:
        head: list[str] = []
        for line in job.stdout:  # the job's own log, up to the summary line of its clean stretch
            head.append(line)
            if line.startswith(CLEAN):
                break
        pid = worker_pid(job.pid, 1)
        assert pid is not None and head and head[-1].startswith(CLEAN), "".join(head)[-3000:]
        with StopDutyCycle(pid, stop_ms=15, period_ms=20):
            out, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, out[-3000:]
    found = _analyze(run)
    # the culprit named alone, by any finding that blames a rank: the fault lab's rule (CULPRIT_KINDS in
    # benchmarks/fault_lab.py). Stops land in compute and in host time alike, so the lost time may be
    # charged as slow compute (straggler) or as a late arrival at the collectives (late_launch): a full
    # suite run on the 2-core box (2026-11-28) gave late_launch, rank 1, steps 51-99, severity 3.5
    culprits = [f for f in found if f["kind"] in CULPRITS]
    assert [f["ranks"] for f in culprits] == [[1]], \
        [(f["kind"], f["ranks"], f["steps"], f["severity"]) for f in found]
    assert not any(0 in f["ranks"] for f in found), [(f["kind"], f["ranks"], f["severity"]) for f in found]


def test_lightning_failure_closes_the_trace_and_says_failed(tmp_path):
    """Lightning calls on_exception when training raises: the tracer is flushed and closed, the
    interception removed, and run.json says the job failed (the HF Trainer gives no such call)."""
    import lightning.pytorch as pl
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from megascope.tracer import api
    from megascope.tracer.lightning_callback import MegascopeCallback
    from megascope.tracer.run_dir import read_manifest

    class Failing(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if self.global_step == 3:
                raise RuntimeError("injected failure at step 3")
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[MegascopeCallback(tmp_path / "run")])
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(Failing(), data)
    assert api.active() is None
    manifest = read_manifest(tmp_path / "run")
    assert manifest["attach"]["status"] == "failed" and "injected failure" in str(manifest["attach"])
    segments = (tmp_path / "run" / "steps").rglob("*.parquet")
    steps = [s for f in segments for s in pq.read_table(f).column("step").to_pylist()]
    assert sorted(steps) == [0, 1, 2]  # the three steps done before the failure, flushed at close
