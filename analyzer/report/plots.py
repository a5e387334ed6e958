"""What the `--html` report plots beside the report object, read from the Run in one step before the
writer runs (html.py takes this and the report, never the Run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from megascope.analyzer.views.heatmap import Heatmap

if TYPE_CHECKING:
    from megascope.analyzer.run import Run

HEATMAP_METRICS = ("compute", "exposed_comm")
BREAKDOWN_COLUMNS = ["compute_s", "exposed_comm_s", "bubble_s", "data_wait_s", "other_s"]


@dataclass
class PlotData:
    mfu: pd.DataFrame
    """The MFU timeline per step: step, step_time_s, tokens_per_s, mfu."""
    breakdown: pd.DataFrame
    """Per step (index), the step time's parts (BREAKDOWN_COLUMNS), mean over ranks."""
    heatmaps: dict[str, Heatmap]
    """HEATMAP_METRICS per rank and step (at most 256 x 300 cells)."""


def plot_data(run: "Run") -> PlotData:
    return PlotData(mfu=run.mfu().per_step,
                    breakdown=run.breakdown().groupby("step")[BREAKDOWN_COLUMNS].mean(),
                    heatmaps={m: run.heatmap(m, max_rows=256, max_cols=300) for m in HEATMAP_METRICS})
