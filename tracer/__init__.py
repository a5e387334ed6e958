"""megascope.tracer: always-on, low-overhead tracing of a training job into a run directory.

    from megascope import tracer
    t = tracer.Tracer(run_dir, rank, cfg.trace, device)
    tracer.activate(t)
    tracer.set_step(step); tracer.set_microbatch(mb, chunk)
    with tracer.span("forward"): ...
    tracer.record_step(tokens=..., loss=...)
    tracer.deactivate(); t.close()

See docs/tracing.md (API, timing, clock alignment, failure handling) and docs/schema.md (tables).
"""

from megascope.tracer.api import (activate, active, deactivate, now_ns, record_step, set_microbatch,
                                  set_step, span)
from megascope.tracer.clock import HostClock
from megascope.tracer.clock_sync import ClockSyncResult
from megascope.tracer.core import Tracer
from megascope.tracer.schedule import LEVELS, every_n_steps
from megascope.tracer.sink import MemorySink, ParquetSegmentSink, Sink

__all__ = [
    "Tracer", "activate", "deactivate", "active", "set_step", "set_microbatch", "span", "record_step",
    "now_ns", "HostClock", "ClockSyncResult", "LEVELS", "every_n_steps", "MemorySink",
    "ParquetSegmentSink", "Sink",
]
