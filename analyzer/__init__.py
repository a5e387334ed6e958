"""megascope.analyzer: DuckDB over a run directory. Returns data; never draws.

    from megascope.analyzer import Run, Finding
    run = Run.open("runs/sim")
    run.mfu().per_step; run.findings(); run.critical_path(step=10)
    build_report(run)  # the `megascope analyze --json` object, built from the Run (never the other way)
"""

from megascope.analyzer.data.store import RunOpenError
from megascope.analyzer.detect.hangs import HangReport
from megascope.analyzer.findings import Finding
from megascope.analyzer.report.build import build_report
from megascope.analyzer.run import Run
from megascope.analyzer.views.heatmap import Heatmap
from megascope.analyzer.views.mfu import MfuTimeline
from megascope.tracer.run_dir import INCIDENTS_FILE, MANIFEST, SELF_CHECK_DIR

# the run directory's names (tracer/run_dir.py) for the layers above, which read runs through the analyzer

__all__ = ["Run", "Finding", "HangReport", "Heatmap", "MfuTimeline", "RunOpenError", "build_report",
           "MANIFEST", "INCIDENTS_FILE", "SELF_CHECK_DIR"]
