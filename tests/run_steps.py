"""Reading a finished run's steps table in tests (Parquet directly, without the analyzer)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq


def losses(run_dir: Path) -> dict[int, float]:
    """Rank 0's loss per step; a step run twice (before and after a restart) keeps its last value."""
    out: dict[int, float] = {}
    for seg in sorted((run_dir / "steps" / "rank=00000").glob("seg-*.parquet")):
        for row in pq.read_table(seg, columns=["step", "loss"]).to_pylist():
            out[int(row["step"])] = row["loss"]
    return out
