"""Write a trace (report/trace.py: build_trace) as Chrome/Perfetto trace JSON; open it in
https://ui.perfetto.dev."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_perfetto(trace: dict[str, Any], path: str | Path) -> int:
    """Write the trace; the number of spans ("X" events) written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        json.dump(trace, fh)
    return sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
