"""megascope.tracer: always-on, low-overhead tracing of a training job into a run directory.

    from megascope import tracer
    with tracer.trace(run_dir, rank, cfg.trace, device) as t:   # = Tracer(...) + activate; close on exit
        tracer.set_step(step); tracer.set_microbatch(mb, chunk)
        with tracer.span("forward"): ...
        tracer.record_step(tokens=..., loss=...)

or, for a job megascope did not write (DDP, FSDP2, a plain loop):

    with tracer.attach(run_dir, model=model, optimizer=opt) as t:
        for batch in t.data(loader): ...; t.step()

See docs/tracing.md (API, timing, clock alignment, failure handling) and docs/schema.md (tables).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): the analyzer and the dashboard read megascope.tracer.schema and
# run_dir and should not pay for torch, which the recording side needs.
_EXPORTS = {
    "activate": "api", "active": "api", "deactivate": "api", "now_ns": "api", "record_step": "api",
    "set_microbatch": "api", "set_step": "api", "span": "api", "trace": "api",
    "attach": "attachment", "Attachment": "attachment",
    "HostClock": "clock", "ClockSyncResult": "clock_sync", "Tracer": "core",
    "LEVELS": "schedule", "every_n_steps": "schedule",
    "MemorySink": "sink", "ParquetSegmentSink": "sink", "Sink": "sink",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megascope.tracer' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"megascope.tracer.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
