"""What every detector is given: one DetectContext per run (Run holds it, diagnose.py passes it to each
detector in turn), instead of per-call state left on the detectors or grids handed between them through
module globals. It carries the inputs (the store, its topology, the warm-up factor of the settings) and
the results a later step reads (the peer-score grid shared by two detectors, the lost-time attribution
that settles the others' findings, the hang report)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

from megascope.analyzer.data.store import Store
from megascope.analyzer.detect.hangs import HangReport, find_hang
from megascope.analyzer.detect.peer_stats import ScoreGrid
from megascope.analyzer.settings import WARMUP_FACTOR

if TYPE_CHECKING:  # lost_time.py, a detector, imports this module
    from megascope.analyzer.detect.lost_time import Attribution


@dataclass
class DetectContext:
    store: Store
    """The run's tables, the derived ones (rank_step, late_arrivals, ...) already built."""
    warmup_factor: float = WARMUP_FACTOR
    """settings.DetectSettings.warmup_factor: leading steps this much slower than the typical step are
    left out of every judgement, the same steps for every detector."""
    peer_grid: ScoreGrid | None = None
    """step_time_s and work_s per rank and step (warm-up dropped) of the straggler detector's score grid,
    the same arrays: the workload imbalance detector takes it (take_peer_grid) instead of reading
    rank_step again (~0.5-1 s at 12,288 ranks x 1,000 steps). Held in between (the flap detector runs
    there: ~210 MB, below the straggler detector's own peak)."""
    attribution: Attribution | None = None
    """The lost-time detector's attribution of each step's lost time (lost_time.py), which
    lost_time.settle applies to the other detectors' findings; None: that detector did not run or
    found too few steps."""
    _hang: HangReport | None = field(default=None, init=False, repr=False)
    _hang_read: bool = field(default=False, init=False, repr=False)

    @property
    def topology(self) -> pd.DataFrame:
        """rank, pp, dp, tp, host, local_rank"""
        return self.store.topology

    def take_peer_grid(self) -> ScoreGrid | None:
        """The shared peer grid, once (its memory goes with the taker)."""
        grid, self.peer_grid = self.peer_grid, None
        return grid

    def hang(self) -> HangReport | None:
        """The run's hang (hangs.find_hang over its in-flight records), looked for once: the hang detector
        and Run.hang (the dashboard asks for it alone) share it."""
        if not self._hang_read:
            self._hang, self._hang_read = find_hang(self.store), True
        return self._hang
