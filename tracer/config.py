"""The tracer's settings: the `[trace]` section of a job config, and what `Tracer` takes on its own
(a plain loop or an attached job needs no megascope trainer to build one)."""

from __future__ import annotations

from dataclasses import dataclass

from megascope.tracer.schedule import TraceLevel


@dataclass
class TraceConfig:
    enabled: bool = True
    """Record spans, steps and GPU health into the run directory."""
    level: TraceLevel = "op"
    """step (steps table only), op (compute, collectives, p2p) or detail (also per-layer tensor-parallel ops)."""
    every: int = 1
    """Record every n-th step (1 = all)."""
    flush_interval_s: float = 5.0
    """Flush buffered events to a Parquet segment at least this often (a killed rank loses at most this
    much; each flush costs the flusher thread a few ms, mostly per file written). A job of more than
    job_flushes_per_s x this many ranks flushes less often: flush_interval(cfg, world)."""
    job_flushes_per_s: float = 400.0
    """The flushes a second the whole job may make together; past it each rank flushes every world /
    this seconds (5 s up to 2,000 ranks, 30.7 s at 12,288). Each flush writes a segment per table and a
    live watcher opens every segment (~0.2 ms of CPU each): at 12,288 ranks and 1 step/s, 5 s flushes
    cost it 2.07 CPU-s a job step, 30.7 s ones 0.94 (benchmarks/watch_scale.py, docs/watch.md): 400 is
    the rate that fits the watcher's 1 CPU-s a step there. The price: live findings, and what a killed
    rank had not flushed, lag by up to the longer interval."""
    flush_events: int = 20000
    """... or when this many events are buffered."""
    max_buffered_events: int = 500000
    """Above this many unflushed events new events are dropped and counted (slow or full disk)."""
    hang_timeout_s: float = 60.0
    """A collective in flight longer than this is written to inflight/."""
    clock_sync_every: int = 100
    """Re-estimate clock offsets to rank 0 every n steps (0 = only at start); a step count, not seconds,
    because every rank must join the same ping-pong round."""
    nvml: bool = True
    """Sample GPU health with NVML (switches itself off without a GPU)."""
    nvml_interval_s: float = 1.0
    """NVML sampling period."""
    edge_summaries: bool = True
    """Also write each step's summary rows beside the events (tracer/edge_summary.py: what the analyzer
    derives from them, computed on the flusher thread), so the analysis of a big job reads those."""
    summary_every: int = 50
    """Rank 0 prints one summary line every n steps, also to the `logging` logger `megascope`: rolling
    step time min / median / max and the slowest ranks, chronic (a live watcher's open findings) apart
    from one-off stalls (tracer/step_summary.py); 0 = off."""
    tensorboard_dir: str = ""
    """Also write the summary's window to TensorBoard under this folder (tracer/tracker_logs.py: step time
    min / median / max, MFU, live findings opened and ended with their cause and cost); needs the
    `tensorboard` extra and summary_every > 0; "" = off."""
    cupti: bool = False
    """Record kernel activity with CUPTI (cupti-python) into the kernels table."""
    cupti_every: int = 1
    """Record kernel activity on every n-th step only (1 = all). CUPTI costs ~100 us per recorded kernel
    (gpu-2b on an H200: 11.5k kernels, +1.1 s per recorded 1.6 s step; docs/measurements.md "GPU"), so
    a job that keeps it on samples: every 100th step is ~0.7% by that arithmetic (not yet measured)."""
    cupti_buffer_mb: int = 8
    """Size of each buffer CUPTI fills with kernel records (MiB); CUPTI hands a buffer back when it is
    full or flushed (every flush interval), so larger buffers mean fewer, bigger hand-overs."""


def flush_interval(cfg: TraceConfig, world: int) -> float:
    """Seconds between one rank's flushes in a job of `world` ranks: cfg.flush_interval_s, stretched so
    that the job makes at most cfg.job_flushes_per_s flushes a second together."""
    return max(cfg.flush_interval_s, world / cfg.job_flushes_per_s)
