"""What a partial run is missing, in sentences: no steps yet, ranks without data, reader warnings."""

from __future__ import annotations

import pandas as pd

from megascope.analyzer import Run


def describe_gaps(run: Run, steps: pd.DataFrame | None = None) -> list[str]:
    """Sentences about what is missing from this run so far (empty for a complete run)."""
    messages = list(run.warnings)
    steps = run.steps() if steps is None else steps
    if steps.empty:
        messages.append("No steps recorded yet: the job has not finished its first step "
                        "(pages fill in on their own while live refresh is on).")
        return messages
    expected = set(int(r) for r in run.topology["rank"]) if not run.topology.empty else set()
    missing = sorted(expected - set(int(r) for r in steps["rank"].unique()))
    if missing:
        messages.append(f"{len(missing)} of {len(expected)} ranks have no step records: "
                        f"{_ranks_text(missing)} (a rank that died, never started, or has not flushed).")
    last_by_rank = steps.groupby("rank")["step"].max()
    behind = last_by_rank[last_by_rank < last_by_rank.max()]
    if len(behind):
        messages.append(f"{len(behind)} ranks are behind the newest step {int(last_by_rank.max())}: "
                        f"{_ranks_text(sorted(int(r) for r in behind.index))}.")
    return messages


def _ranks_text(ranks: list[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f", ... ({len(ranks) - limit} more)" if len(ranks) > limit else "")
