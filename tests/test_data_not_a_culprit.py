"""Issue 31, item 5: sequence-length imbalance gets no false culprit beside `workload_imbalance`.

A 128-GPU job (dp32 x pp2 x cp2) whose replicas draw long sequences for several steps in a row (AR(1),
rho 0.8), from the independent generator (samples/independent_gen.py, written from the NDTimeline
format, not from the detectors), imported with the real importer. The job timed compute and
collectives only (no p2p rows), so a replica's stages waiting on each other's longer compute are host
gaps: replica 12's four ranks looked like late launchers on steps 0-7 (own time 27% above their stage
peers, 12% of it their own compute, matched by their other stage's). Its lost time is the data's."""

from __future__ import annotations

import contextlib
import io

from megascope.analyzer import Run
from megascope.cli import main as cli
from megascope.samples.independent_gen import GenSpec, Noise, job_yaml, trace_frame


def test_long_sequences_in_one_replica_are_the_data_not_a_late_launch(tmp_path):
    spec = GenSpec(dp=32, tp=1, pp=2, cp=2, steps=50, micro=4, seed=0,
                   noise=Noise(sigma=0.02, seq_sigma=0.25, gc_prob=0.02, gc_s=0.003, seq_rho=0.8))
    df = trace_frame(spec)
    df[~df.optype.str.contains("send|recv")].to_parquet(tmp_path / "trace.parquet", index=False)
    (tmp_path / "job.yaml").write_text(job_yaml(spec))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["import", "ndtimeline", str(tmp_path / "trace.parquet"), "--meta", str(tmp_path / "job.yaml"),
                    "--out", str(tmp_path / "run")]) == 0
    found = Run.open(tmp_path / "run").findings()
    assert [f.kind for f in found] == ["workload_imbalance"], [(f.kind, f.ranks, f.steps) for f in found]
