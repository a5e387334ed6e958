"""Trace simulator: writes a run directory exactly as the tracer does (same schema, same paths, a
run.json with "source": "simulator" and the injected faults as ground truth) for any dp x tp x pp
(x vpp) layout, with a 1F1B / interleaved timeline, realistic noise and injected faults.

    from megascope.samples.simulator import SimConfig, simulate
    simulate("runs/sim", SimConfig(dp=4, tp=2, pp=4, steps=30, inject=["straggler:rank=5,slowdown=1.1,from=10"]))

Scales to 12,288 ranks x 100 steps: the timeline is vectorized over the ranks of a pipeline stage and
written in step windows (one Parquet segment per rank per window) so memory stays bounded.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megascope.samples.faults_sim import Fault, check_ranks, parse_fault
from megascope.samples.sim_model import DEFAULT_MODEL, Costs, Hardware, Noise, costs
from megascope.samples.sim_timeline import StageLog, Timeline
from megascope.tracer import run_dir as rd
from megascope.tracer.layout import Layout
from megascope.tracer.schema import EVENTS, SCHEMA_VERSION, STEPS

START_NS = 1_700_000_000_000_000_000  # fixed epoch so simulated runs are reproducible


@dataclass
class SimConfig:
    dp: int = 2
    tp: int = 2
    pp: int = 2
    vpp: int = 1
    steps: int = 20
    micro_batches: int = 8
    micro_batch_size: int = 1
    seed: int = 0
    inject: list[str] = field(default_factory=list)
    model: dict = field(default_factory=lambda: dict(DEFAULT_MODEL))
    noise: Noise = field(default_factory=Noise)
    hardware: Hardware = field(default_factory=Hardware)
    rows_per_window: int = 12_000_000
    """Bound on events simulated before they are written out (memory: ~40 bytes per event)."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def _validate(cfg: SimConfig) -> list[Fault]:
    for name in ("dp", "tp", "pp", "vpp", "steps", "micro_batches"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.vpp > 1 and (cfg.pp == 1 or cfg.micro_batches % cfg.pp):
        raise ValueError(f"--vpp > 1 needs --pp > 1 and micro-batches ({cfg.micro_batches}) divisible by pp")
    faults = [parse_fault(spec) for spec in cfg.inject]
    check_ranks(faults, cfg.world, cfg.pp)
    return faults


def _rank_table(cfg: SimConfig) -> tuple[np.ndarray, Layout]:
    dims = Layout(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, vpp=cfg.vpp)  # the one owner of the rank order
    return np.array([[dims.rank_of(s, d, t) for d in range(cfg.dp) for t in range(cfg.tp)]
                     for s in range(cfg.pp)], dtype=np.int32), dims


def simulate(out_dir: str | Path, cfg: SimConfig,
             progress: Callable[[int, int], None] | None = None) -> Path:
    """Simulate `cfg` into the run directory `out_dir` (created); returns its path."""
    faults = _validate(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table, dims = _rank_table(cfg)
    c = costs(cfg.model, cfg.dp, cfg.tp, cfg.pp, cfg.vpp, cfg.micro_batches, cfg.micro_batch_size, cfg.hardware)
    timeline = Timeline(cfg.dp, cfg.tp, cfg.pp, cfg.vpp, cfg.micro_batches, c, cfg.noise, faults, table, cfg.seed)
    hang_step = min((f.first for f in faults if f.kind == "hang"), default=None)
    last_step = cfg.steps - 1 if hang_step is None else min(cfg.steps - 1, hang_step + 1)
    events_per_step = cfg.world * (6 * cfg.micro_batches * cfg.vpp + 4)
    window = max(1, cfg.rows_per_window // max(1, events_per_step))
    _write_manifest(out, cfg, dims, c, faults)
    writer = _SegmentWriter(out, table, cfg, c)
    pending: list[int] = []
    for step in range(last_step + 1):
        timeline.run_step(step)
        pending.append(step)
        if len(pending) == window or step == last_step:
            writer.flush(timeline, pending)
            pending = []
        if progress:
            progress(step + 1, last_step + 1)
    if timeline.inflight:
        _write_inflight(out, timeline.inflight)
    return out


class _SegmentWriter:
    """Turns held steps into one events and one steps segment per rank (named seg-NNNNNN.parquet)."""

    def __init__(self, out: Path, table: np.ndarray, cfg: SimConfig, c: Costs) -> None:
        self.out, self.table, self.cfg, self.costs = out, table, cfg, c
        self.index = 0

    def flush(self, tl: Timeline, steps: list[int]) -> None:
        for s, log in enumerate(tl.logs):
            self._events(s, log, steps)
            log.step_rows = []
        self._steps(tl, steps)
        tl.step_bounds = []
        self.index += 1

    def _events(self, s: int, log: StageLog, steps: list[int]) -> None:
        k, e, n = len(steps), len(log.desc), self.table.shape[1]
        times = {}
        for col, pos in (("issue_ns", 1), ("start_ns", 2), ("end_ns", 3)):
            arr = np.stack([np.stack([row[pos] for row in rows]) for rows in log.step_rows])
            arr = np.where(np.isfinite(arr), arr, 0.0)  # ops that never completed (hang) are dropped below
            times[col] = np.ascontiguousarray((START_NS + np.rint(arr * 1e9).astype(np.int64)).reshape(k * e, n).T)
        valid = np.ascontiguousarray(np.stack([np.stack([row[4] for row in rows])
                                               for rows in log.step_rows]).reshape(k * e, n).T)
        seq = pa.array(np.array([[row[0] for row in rows] for rows in log.step_rows], dtype=np.int64).reshape(-1))
        static = {
            "step": pa.array(np.repeat(np.asarray(steps, dtype=np.int64), e)),
            "microbatch": pa.array(np.tile([d.microbatch for d in log.desc], k).astype(np.int32)),
            "chunk": pa.array(np.tile([d.chunk for d in log.desc], k).astype(np.int16)),
            "name": pa.array(np.tile([d.name for d in log.desc], k).tolist(), pa.string()),
            "kind": pa.array(np.tile([d.kind for d in log.desc], k).tolist(), pa.string()),
            "group": pa.array(np.tile([d.group for d in log.desc], k).tolist(), pa.string()),
            "seq": seq,
            "bytes": pa.array(np.tile([d.bytes for d in log.desc], k).astype(np.int64)),
        }
        peer_stage = np.tile([d.peer_stage for d in log.desc], k)
        for j in range(n):
            rank = int(self.table[s, j])
            peer = np.where(peer_stage >= 0, self.table[np.maximum(peer_stage, 0), j], -1).astype(np.int32)
            cols = dict(static, rank=pa.array(np.full(k * e, rank, dtype=np.int32)), peer=pa.array(peer),
                        issue_ns=pa.array(times["issue_ns"][j]), start_ns=pa.array(times["start_ns"][j]),
                        end_ns=pa.array(times["end_ns"][j]))
            tbl = pa.Table.from_arrays([cols[f.name] for f in EVENTS], schema=EVENTS)
            if not valid[j].all():
                tbl = tbl.filter(pa.array(valid[j]))
            self._write(tbl, "events", rank)

    def _steps(self, tl: Timeline, steps: list[int]) -> None:
        c, cfg = self.costs, self.cfg
        start = np.stack([b[0] for b in tl.step_bounds])   # (k, pp, N)
        end = np.stack([b[1] for b in tl.step_bounds])
        alive = np.stack([b[2] for b in tl.step_bounds])
        step_arr = np.asarray(steps, dtype=np.int64)
        lr = 3e-4 * 0.5 * (1 + np.cos(np.pi * step_arr / max(cfg.steps, 1)))
        rng = np.random.default_rng(cfg.seed + 7 + steps[0])
        loss = 2.2 + 8.0 * np.exp(-step_arr / 30.0) + rng.normal(0, 0.02, len(steps))
        grad_norm = 1.0 + 0.5 * np.exp(-step_arr / 20.0) + rng.normal(0, 0.05, len(steps))
        for s in range(cfg.pp):
            for j in range(self.table.shape[1]):
                keep = alive[:, s, j]
                cols: dict[str, np.ndarray] = {
                    "rank": np.full(len(steps), self.table[s, j], dtype=np.int32), "step": step_arr,
                    "start_ns": START_NS + np.rint(start[:, s, j] * 1e9).astype(np.int64),
                    "end_ns": START_NS + np.rint(end[:, s, j] * 1e9).astype(np.int64),
                    "tokens": np.full(len(steps), c.tokens_per_replica, dtype=np.int64),
                    "loss": loss if s == cfg.pp - 1 else np.full(len(steps), math.nan),
                    "lr": lr, "grad_norm": grad_norm,
                    "model_flops": np.full(len(steps), c.model_flops_per_step),
                    "dropped_events": np.zeros(len(steps), dtype=np.int64),
                }
                tbl = pa.Table.from_arrays([pa.array(cols[f.name][keep], f.type) for f in STEPS], schema=STEPS)
                if tbl.num_rows:
                    self._write(tbl, "steps", int(self.table[s, j]))

    def _write(self, tbl: pa.Table, name: str, rank: int) -> None:
        folder = rd.table_dir(self.out, name, rank)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"seg-{self.index:06d}.parquet"
        tmp = folder / f".seg-{self.index:06d}.parquet.tmp"
        pq.write_table(tbl, tmp)
        os.replace(tmp, path)   # like the tracer: readers never see half a segment


def _write_manifest(out: Path, cfg: SimConfig, dims: Layout, c: Costs, faults: list[Fault]) -> None:
    from megascope.trainer.config import JobConfig
    rph = cfg.hardware.ranks_per_host
    world = cfg.world
    job = JobConfig()
    job.parallel.dp, job.parallel.tp, job.parallel.pp, job.parallel.vpp = cfg.dp, cfg.tp, cfg.pp, cfg.vpp
    job.train.steps, job.train.micro_batch = cfg.steps, cfg.micro_batch_size
    job.train.global_batch = cfg.micro_batch_size * cfg.micro_batches * cfg.dp
    for key in ("n_layers", "hidden", "n_heads", "seq_len", "vocab_size", "window", "ffn_mult"):
        setattr(job.model, key, cfg.model[key])
    job.run_dir, job.inject = str(out), list(cfg.inject)
    topology = dims.topology(range(world), hosts={r: f"node{r // rph:04d}" for r in range(world)},
                             local_ranks={r: r % rph for r in range(world)})
    rd.write_manifest(out, {
        "schema_version": SCHEMA_VERSION,
        "run_id": f"sim-{cfg.dp}x{cfg.tp}x{cfg.pp}-s{cfg.seed}",
        "start_time": np.datetime_as_string(np.datetime64(START_NS, "ns"), unit="s") + "Z",
        "source": "simulator",
        "config": job.to_dict(),
        "topology": topology,
        "model": {k: cfg.model[k] for k in ("n_layers", "hidden", "n_heads", "seq_len", "vocab_size",
                                            "window", "ffn_mult")},
        "micro_batches": cfg.micro_batches,
        "schedule": "interleaved" if cfg.vpp > 1 else ("1f1b" if cfg.pp > 1 else "none"),
        "peak_flops": {"per_device": cfg.hardware.peak_flops, "source": "simulator",
                       "device": cfg.hardware.device},
        "clock_offsets_ns": {str(r): 0 for r in range(world)},
        "versions": {"megascope": "0.1.0", "simulator": 1},
        "injected": [dict(f.to_dict(), spec=spec) for f, spec in zip(faults, cfg.inject)],
    })


def _write_inflight(out: Path, records: list[dict]) -> None:
    for rec in records:
        rec = dict(rec)
        rec["since_ns"] = START_NS + int(round(rec.pop("since_s") * 1e9))
        last = rec.get("last_completed")
        if last:
            last["end_ns"] = START_NS + int(round(last.pop("end_s") * 1e9))
            last["step"] = rec["step"]
        rd.write_json_atomic(rd.inflight_dir(out) / f"rank={rec['rank']:05d}.json", rec)
