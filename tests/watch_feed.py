"""Test helper for the watcher: a simulated run written one step at a time, as a live job writes it.

`simulate_steps` writes a finished simulated run; `Feeder` splits its segments by step and lands
them in a live directory one step at a time (seg-NNNNNN = step N, temporary name then rename, as the
tracer does), so a watcher beside it sees the run grow step by step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from megascope.samples.simulator import SimConfig, simulate


def simulate_steps(out: Path, dp: int = 4, tp: int = 1, pp: int = 2, steps: int = 24, micro_batches: int = 4,
                   inject: list[str] | None = None, seed: int = 0) -> Path:
    cfg = SimConfig(dp=dp, tp=tp, pp=pp, steps=steps, micro_batches=micro_batches, seed=seed, inject=inject or [])
    return simulate(out, cfg)


class Feeder:
    """Copies a finished run into `live` one segment index (= one step) at a time."""

    def __init__(self, source: Path, live: Path) -> None:
        self.source, self.live = source, live
        live.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "run.json", live / "run.json")
        self.tables: list[tuple[Path, object]] = []  # (relative folder, table) per rank and table
        steps: set[int] = set()
        for table in ("events", "steps"):
            for folder in sorted((source / table).glob("rank=*")):
                segments = sorted(folder.glob("seg-*.parquet"))
                data = pa.concat_tables([pq.read_table(f, partitioning=None) for f in segments])
                self.tables.append((folder.relative_to(source), data))
                steps.update(data.column("step").to_pylist())
        self.steps = sorted(steps)
        self.next = 0

    @property
    def total(self) -> int:
        return len(self.steps)

    def feed(self, count: int = 1) -> int:
        """Land the next `count` steps; returns the last step landed (-1: none yet)."""
        for _ in range(count):
            if self.next >= self.total:
                break
            step = self.steps[self.next]
            for folder, data in self.tables:
                rows = data.filter(pc.equal(data.column("step"), step))
                if not rows.num_rows:
                    continue
                dest = self.live / folder / f"seg-{step:06d}.parquet"
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name("." + dest.name + ".tmp")
                pq.write_table(rows, tmp)
                os.replace(tmp, dest)
            self.next += 1
        return self.steps[self.next - 1] if self.next else -1

    def feed_inflight(self) -> None:
        """The hang records (RUN/inflight), as a watchdog writes them once ops stay stuck."""
        if (self.source / "inflight").is_dir():
            shutil.copytree(self.source / "inflight", self.live / "inflight", dirs_exist_ok=True)
