"""A big job's ranks flush less often (tracer.config.flush_interval): the job-wide flush rate stays at
most job_flushes_per_s, so a live watcher's per-file cost does not grow with the world size."""

import pytest

from megascope import tracer
from megascope.tracer.config import TraceConfig, flush_interval


def test_the_interval_stretches_past_the_job_flush_rate():
    cfg = TraceConfig()
    assert flush_interval(cfg, 1) == flush_interval(cfg, 2000) == cfg.flush_interval_s == 5.0
    assert flush_interval(cfg, 12288) == pytest.approx(30.72)
    assert flush_interval(cfg, 4000) == pytest.approx(10.0)
    # the user's own interval wins when it is the longer one; a higher rate keeps 5 s further
    assert flush_interval(TraceConfig(flush_interval_s=60), 12288) == 60
    assert flush_interval(TraceConfig(job_flushes_per_s=4000), 12288) == 5.0


@pytest.mark.parametrize("world, expected", [("4000", 10.0), ("8", 5.0), ("not-a-number", 5.0)])
def test_a_tracer_takes_the_launchers_world_size(monkeypatch, world, expected):
    monkeypatch.setenv("WORLD_SIZE", world)  # what torchrun exports; no process group here
    with tracer.trace(None, 0, TraceConfig(nvml=False), sink=tracer.MemorySink()) as t:
        assert t.flush_interval_s == pytest.approx(expected)
        assert t.flusher is not None and t.flusher.interval_s == pytest.approx(expected)
