"""megascope.analyzer: DuckDB over a run directory. Returns data; never draws.

    from megascope.analyzer import Run, Finding
    run = Run.open("runs/sim")
    run.mfu().per_step; run.findings(); run.critical_path(step=10)
"""

from megascope.analyzer.findings import Finding
from megascope.analyzer.hangs import HangReport
from megascope.analyzer.heatmap import Heatmap
from megascope.analyzer.mfu import MfuTimeline
from megascope.analyzer.run import Run
from megascope.analyzer.store import RunOpenError

__all__ = ["Run", "Finding", "HangReport", "Heatmap", "MfuTimeline", "RunOpenError"]
