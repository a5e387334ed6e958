"""The tracing API used by training code: one active tracer per process, ambient step, spans.

    with trace(run_dir, rank, cfg, device) as t:      # or: t = Tracer(...); activate(t) ... deactivate(); t.close()
        set_step(step); set_microbatch(mb, chunk)
        with span("forward"): ...            or    @span("optimizer", kind="host")
        record_step(tokens=..., loss=...)

Like torch.profiler's active profiler, the active tracer is one slot set by activate(); nothing is
created at import. With no active tracer, or in a step the schedule skips, a span costs one object
and two attribute checks.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from megascope.tracer.core import Tracer

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from megascope.tracer.clock import HostClock
    from megascope.tracer.config import TraceConfig
    from megascope.tracer.schedule import Schedule
    from megascope.tracer.sink import Sink

F = TypeVar("F", bound=Callable[..., Any])

_active: Tracer | None = None
_monotonic_ns = time.monotonic_ns


def activate(tracer: Tracer) -> None:
    """Make `tracer` the one that spans, comm wrappers and set_step report to."""
    global _active
    if not isinstance(tracer, Tracer):
        raise TypeError(f"activate() takes a Tracer, got {type(tracer).__name__}")
    _active = tracer
    if tracer.cupti is not None:
        tracer.cupti.set_recording(True)


def deactivate() -> None:
    """No active tracer: every span and comm wrapper becomes a no-op again, and CUPTI records no kernels."""
    global _active
    if _active is not None and _active.cupti is not None:
        _active.cupti.set_recording(False)
    _active = None


def active() -> Tracer | None:
    return _active


class trace:
    """A Tracer active for the length of a `with` block, as `torch.profiler.profile` is:

        with tracer.trace(run_dir, rank, cfg.trace, device) as t:   # t: the Tracer
            for step in ...: tracer.set_step(step); ...

    The arguments are Tracer's. Entering (or start()) builds the Tracer, which starts its threads, and
    makes it the active one; leaving (or stop()) gives the slot back to the tracer active before and
    closes this one: threads stopped and every buffered row flushed, also when the block raised. The
    block's exception is never swallowed.
    """

    def __init__(self, run_dir: str | Path | None, rank: int, cfg: TraceConfig | None = None,
                 device: torch.device | str = "cpu", *, sink: Sink | None = None,
                 clock: HostClock | None = None, schedule: Schedule | None = None) -> None:
        self._args = (run_dir, rank, cfg, device)
        self._kwargs: dict[str, Any] = dict(sink=sink, clock=clock, schedule=schedule)
        self.tracer: Tracer | None = None
        """The Tracer once started (after stop(), closed: its stats() stay readable)."""
        self._previous: Tracer | None = None
        self._running = False

    def start(self) -> Tracer:
        """Build the Tracer and activate it; returns it."""
        global _active
        if self._running:
            raise RuntimeError("this trace is already started; use one trace object per `with`")
        tracer = Tracer(*self._args, **self._kwargs)
        self._previous, self.tracer, self._running = _active, tracer, True
        _active = tracer
        return tracer

    def stop(self) -> None:
        """Deactivate and close (flush) the Tracer; idempotent."""
        global _active
        tracer = self.tracer
        if not self._running or tracer is None:
            return
        self._running = False
        if _active is tracer:  # a tracer activated by hand inside the block stays active
            _active = self._previous
        self._previous = None
        tracer.close()  # close never raises: failures are counted and logged (monitoring never crashes training)

    def __enter__(self) -> Tracer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()  # returns None: the block's exception, if any, propagates


def set_step(step: int) -> None:
    """Ambient step for what follows; also decides (schedule, level) whether its spans are recorded."""
    tracer = _active
    if tracer is not None:
        tracer.set_step(step)


def set_microbatch(microbatch: int, chunk: int = -1) -> None:
    """Ambient micro-batch and virtual-pipeline chunk for spans and comm ops that follow."""
    tracer = _active
    if tracer is not None:  # Tracer.set_microbatch, inlined (called per micro-batch and chunk)
        tracer.microbatch, tracer.chunk = microbatch, chunk


def now_ns() -> int:
    """Now on the job's aligned clock (epoch ns); without an active tracer, this host's epoch."""
    tracer = _active
    if tracer is not None:
        return tracer.now_ns()
    import time

    return time.time_ns()


def record_step(step: int | None = None, start_ns: int | None = None, end_ns: int | None = None,
                tokens: int = 0, loss: float = math.nan, lr: float = math.nan,
                grad_norm: float = math.nan, model_flops: float = math.nan) -> None:
    """Append this rank's steps-table row. start/end default to set_step() .. now; pass values from
    now_ns() (the aligned clock), not time.time_ns(), if you measure them yourself."""
    tracer = _active
    if tracer is not None:
        tracer.record_step(step, start_ns, end_ns, tokens, loss, lr, grad_norm, model_flops)


class span:
    """Time a region: `with span("forward"): ...` or `@span("optimizer", kind="host")`.

    kind: compute | collective | p2p | host. microbatch/chunk default to the ambient values.
    level="detail" spans are recorded only at trace level detail. As a decorator the tracer is looked
    up at each call, so decorating at import time (before activate) works. Not re-entrant: use a
    fresh span object per `with`.
    """

    __slots__ = ("name", "kind", "group", "peer", "bytes", "microbatch", "chunk", "detail",
                 "_tracer", "_token")

    def __init__(self, name: str, kind: str = "compute", group: str = "", peer: int = -1, bytes: int = 0,
                 microbatch: int | None = None, chunk: int | None = None, level: str = "op") -> None:
        self.name, self.kind, self.group, self.peer, self.bytes = name, kind, group, peer, bytes
        self.microbatch, self.chunk = microbatch, chunk
        self.detail = level == "detail"
        self._tracer: Tracer | None = None

    def __enter__(self) -> "span":
        tracer = _active
        if tracer is None or not (tracer.recording_detail if self.detail else tracer.recording):
            self._tracer = None
            return self
        self._tracer = tracer
        if tracer.pending_works:  # async collectives in flight: observe their completion here
            tracer.completion.sweep()  # type: ignore[union-attr]
        # CPU fast path inlined (the common case; ~2x cheaper than a call into the tracer per edge)
        self._token = _monotonic_ns() if tracer.timeline is None else tracer.begin_span()
        return self

    def __exit__(self, *exc_info: object) -> None:  # None: the block's exception propagates
        tracer = self._tracer
        if tracer is None:
            return
        self._tracer = None
        if tracer.timeline is not None:
            tracer.end_span(self.name, self.kind, self.group, self.peer, self.bytes,
                            self.microbatch, self.chunk, self._token)
            return
        end = _monotonic_ns()
        try:  # guarded like every tracer entry point: monitoring never raises into training
            if tracer.pending_works:
                tracer.completion.sweep(end + tracer.clock.shift_ns)  # type: ignore[union-attr]
            shift = tracer.clock.shift_ns
            start = self._token + shift
            mb, chunk = self.microbatch, self.chunk
            row = (tracer.step, tracer.microbatch if mb is None else mb,
                   tracer.chunk if chunk is None else chunk, self.name, self.kind,
                   self.group, -1, self.peer, self.bytes, start, start, end + shift)
            events = tracer._events
            if len(events.rows) < events.room:  # TableBuffer.append, inlined
                events.rows.append(row)
            else:
                events.append(row)
        except Exception as exc:
            tracer._failed("span end", exc)
        return

    def __call__(self, fn: F) -> F:
        args = (self.name, self.kind, self.group, self.peer, self.bytes, self.microbatch, self.chunk,
                "detail" if self.detail else "op")

        @functools.wraps(fn)
        def traced(*a: Any, **kw: Any) -> Any:
            with span(*args):
                return fn(*a, **kw)

        return traced  # type: ignore[return-value]
