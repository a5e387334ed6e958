"""The per-rank Tracer: ambient step state, span/comm recording, and the background machinery.

One Tracer per process (rank). It owns the buffers and the flusher thread, the hang watchdog, the host
sampler (host_steps), and on a GPU the CUDA event resolver, the NVML sampler and (optionally) CUPTI.
Everything the training thread calls is guarded: an error inside the tracer is logged and counted,
never raised.
Use it through megascope.tracer.api (activate, set_step, span, record_step), not directly.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megascope.tracer import run_dir as rundir
from megascope.tracer.buffer import TableBuffer
from megascope.tracer.clock import HostClock
from megascope.tracer.clock_sync import ClockSyncResult, estimate_offsets
from megascope.tracer.completion import CompletionTracker
from megascope.tracer.config import TraceConfig, flush_interval
from megascope.tracer.edge_summary import SummarizingSink
from megascope.tracer.flusher import Flusher
from megascope.tracer.host_sampler import HostSampler
from megascope.tracer.schedule import Schedule, check_level, every_n_steps
from megascope.tracer.schema import TRACED, WAIT_SUFFIX
from megascope.tracer.sink import ParquetSegmentSink, Sink
from megascope.tracer.step_summary import StepSummary
from megascope.tracer.tracker_logs import open_tracker
from megascope.tracer.watchdog import CommOp, HangWatchdog, InflightRegistry

if TYPE_CHECKING:  # for annotations; the three recorders are imported where used (each needs its own hardware)
    from torch.distributed import ProcessGroup

    from megascope.tracer.cupti_kernels import CuptiKernelRecorder
    from megascope.tracer.gpu_timing import CudaTimeline
    from megascope.tracer.nvml_sampler import NvmlSampler

log = logging.getLogger("megascope.tracer")
_monotonic_ns = time.monotonic_ns


def _job_world() -> int:
    """The job's rank count: the default group's size once torch.distributed is up, else what the
    launcher exported (torchrun's WORLD_SIZE), else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


class Tracer:
    """Records one rank's spans, comm ops and steps into `sink` (default: Parquet segments in run_dir).

    run_dir may be None only with an injected sink (then in-flight records are logged, not written).
    `clock` and `schedule` are injectable for tests; by default the clock is this host's and the
    schedule records every `cfg.every`-th step.
    """

    def __init__(self, run_dir: str | Path | None, rank: int, cfg: TraceConfig | None = None,
                 device: torch.device | str = "cpu", *, sink: Sink | None = None,
                 clock: HostClock | None = None, schedule: Schedule | None = None) -> None:
        cfg = cfg if cfg is not None else TraceConfig()
        if run_dir is None and sink is None:
            raise ValueError("Tracer needs a run_dir or an injected sink (e.g. MemorySink())")
        self.cfg, self.rank, self.run_dir = cfg, int(rank), run_dir
        self.device = torch.device(device)
        self.level = check_level(cfg.level)
        self.enabled = bool(cfg.enabled)
        self.flush_interval_s = flush_interval(cfg, _job_world())
        """Seconds between flushes: cfg.flush_interval_s, longer in a big job (config.flush_interval)."""
        self.schedule = schedule or every_n_steps(cfg.every)
        self.clock = clock or HostClock()
        self.is_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        # ambient state, read on the hot path
        self.step, self.microbatch, self.chunk = -1, -1, -1
        self.recording = False
        self.recording_detail = False
        self.step_start_ns = self.clock.now_ns()
        self.internal_errors = 0
        self.last_sync: ClockSyncResult | None = None
        self._seq: dict[Any, int] = {}
        self._comm_lock = threading.Lock()
        self._closed = False
        self.registry = InflightRegistry()
        self.buffers = {name: TableBuffer(name, schema, self.rank, cfg.max_buffered_events, cfg.flush_events)
                        for name, schema in TRACED.items()}
        self._events = self.buffers["events"]
        self.sink = sink if sink is not None else ParquetSegmentSink(run_dir, self.rank)  # type: ignore[arg-type]
        if cfg.edge_summaries and self.enabled:
            self.sink = SummarizingSink(self.sink, self.rank)
        self.summary = (StepSummary(run_dir, cfg.summary_every, tracker=open_tracker(cfg.tensorboard_dir, run_dir))
                        if self.enabled and self.rank == 0 and cfg.summary_every > 0 else None)
        """Rank 0's summary line in the job's log every cfg.summary_every steps (and in TensorBoard with
        cfg.tensorboard_dir: tracker_logs.py)."""
        self.flusher: Flusher | None = None
        self.watchdog: HangWatchdog | None = None
        self.timeline: CudaTimeline | None = None
        self.nvml: NvmlSampler | None = None
        self.cupti: CuptiKernelRecorder | None = None
        self.completion: CompletionTracker | None = None
        self.host: HostSampler | None = None
        """Per-step host evidence (GC, CPU time, run delay, cgroup throttling) for host_steps."""
        self.pending_works: deque = deque()
        """Async works not yet seen complete (the completion tracker's); the hot path tests it for
        emptiness and, when not empty, sweeps: completion observed at the training thread's own events."""
        if self.enabled:
            self._start_background()
            atexit.register(self.close)

    def _start_background(self) -> None:
        cfg = self.cfg
        self.flusher = Flusher(self.buffers, self.sink, self.flush_interval_s)
        self.completion = CompletionTracker()
        self.pending_works = self.completion.pending
        try:
            self.host = HostSampler()
        except Exception as exc:  # no host evidence; tracing goes on
            self._failed("starting the host sampler", exc)
        self.watchdog = HangWatchdog(self.run_dir, self.rank, self.registry, cfg.hang_timeout_s,
                                     self.clock.now_ns, self._ambient)
        if self.is_cuda:
            from megascope.tracer.gpu_timing import CudaTimeline

            self.timeline = CudaTimeline(self.device, self.clock, self._events.append,
                                         self.registry.complete, cfg.max_buffered_events)
        if cfg.nvml:
            from megascope.tracer.nvml_sampler import NvmlSampler

            self.nvml = NvmlSampler(self.device, self.buffers["gpu"].append, self.clock.now_ns,
                                    cfg.nvml_interval_s)
        if cfg.cupti:
            from megascope.tracer.cupti_kernels import CuptiKernelRecorder

            self.cupti = CuptiKernelRecorder(self.device, self.clock, self.buffers["kernels"].append,
                                             self.flush_interval_s, cfg.cupti_buffer_mb, cfg.cupti_every)

    # -- guarded failure path ----------------------------------------------------------------
    def _failed(self, where: str, exc: BaseException) -> None:
        self.internal_errors += 1
        if self.internal_errors <= 3 or self.internal_errors % 1000 == 0:
            log.warning("tracer: %s failed (%r); %d tracer errors so far, training continues",
                        where, exc, self.internal_errors)

    def _ambient(self) -> dict[str, int]:
        return {"step": self.step, "microbatch": self.microbatch, "chunk": self.chunk}

    # -- ambient state -----------------------------------------------------------------------
    def now_ns(self) -> int:
        """Now on the job's aligned clock (Unix epoch ns, rank 0's time base)."""
        return _monotonic_ns() + self.clock.shift_ns

    def set_step(self, step: int) -> None:
        try:
            self.step, self.microbatch, self.chunk = int(step), -1, -1
            self.step_start_ns = self.now_ns()
            if self.pending_works and self.completion is not None:  # set whenever works are pending
                self.completion.sweep(self.step_start_ns)
            if self.cupti is not None:
                self.cupti.set_step(self.step)
            record = self.enabled and self.level != "step" and bool(self.schedule(self.step))
            self.recording = record
            self.recording_detail = record and self.level == "detail"
        except Exception as exc:
            self.recording = self.recording_detail = False
            self._failed("set_step", exc)

    def set_microbatch(self, microbatch: int, chunk: int = -1) -> None:
        self.microbatch, self.chunk = int(microbatch), int(chunk)

    # -- spans (hot path) --------------------------------------------------------------------
    def begin_span(self) -> Any:
        """Start token: aligned host ns on CPU, (issue ns, start event) on GPU."""
        try:
            if self.timeline is not None:
                return (_monotonic_ns() + self.clock.shift_ns, self.timeline.record())
            return _monotonic_ns()
        except Exception as exc:
            self._failed("span start", exc)
            return None

    def end_span(self, name: str, kind: str, group: str, peer: int, nbytes: int,
                 microbatch: int | None, chunk: int | None, token: Any) -> None:
        if token is None:
            return
        try:
            prefix = (self.step, self.microbatch if microbatch is None else microbatch,
                      self.chunk if chunk is None else chunk, name, kind, group, -1, peer, nbytes)
            if self.timeline is not None:
                self.timeline.submit(prefix, token[0], token[1], self.timeline.record())
                return
            end = _monotonic_ns()
            shift = self.clock.shift_ns
            start = token + shift
            self._events.append(prefix + (start, start, end + shift))
        except Exception as exc:
            self._failed("span end", exc)

    # -- comm ops ----------------------------------------------------------------------------
    def begin_comm(self, name: str, kind: str, group_name: str, group: ProcessGroup | None, seq_key: Any,
                   peer: int, nbytes: int, members: list[int] | None, on_gpu: bool,
                   issue_ns: int | None = None) -> CommOp | None:
        """Register an op about to be issued: sequence number, in-flight entry, issue and start time
        (start = issue on CPU until comm_spans.finish moves it to when an async call returned)."""
        try:
            # observe earlier async ops' completion first (they precede this)
            if self.pending_works and self.completion is not None:
                self.completion.sweep()
            seq = self._seq.get(seq_key, 0)
            self._seq[seq_key] = seq + 1
            op = CommOp(name, kind, group_name, seq, peer, nbytes, self.step, self.microbatch,
                        self.chunk, self.now_ns() if issue_ns is None else issue_ns, group, members)
            if self.recording:
                op.start = self.timeline.record() if (on_gpu and self.timeline is not None) else op.issue_ns
            self.registry.ops[id(op)] = op  # registry.add, inlined (hot path)
            return op
        except Exception as exc:
            self._failed(f"{name} start", exc)
            return None

    def end_comm_host(self, op: CommOp, end_ns: int | None = None) -> None:
        """The host saw `op` complete (CPU ops; GPU ops only when not being timed)."""
        try:
            with self._comm_lock:
                if op.done:
                    return
                op.done = True
            start = op.start
            if type(start) is int:  # host-timed (a CUDA start event is resolved by the timeline)
                end = end_ns if end_ns is not None else _monotonic_ns() + self.clock.shift_ns
                row = (op.step, op.microbatch, op.chunk, op.name, op.kind, op.group_name, op.seq, op.peer,
                       op.nbytes, op.issue_ns, start, end if end > start else start)
                events = self._events
                if len(events.rows) < events.room:  # TableBuffer.append, inlined (hot path)
                    events.rows.append(row)
                else:
                    events.append(row)
            registry = self.registry  # registry.complete, inlined (hot path)
            registry.ops.pop(id(op), None)
            registry.last_completed = op
        except Exception as exc:
            self._failed(f"{op.name} end", exc)

    def end_comm_gpu(self, op: CommOp) -> None:
        """Record `op`'s end event on the current stream; it completes when the GPU gets there."""
        if op.start is None or self.timeline is None or not hasattr(op.start, "query"):
            self.end_comm_host(op)
            return
        try:
            with self._comm_lock:
                if op.done:
                    return
                op.done = True
            self.timeline.submit(op.row_prefix(), op.issue_ns, op.start, self.timeline.record(), op)
        except Exception as exc:
            self.registry.complete(op)
            self._failed(f"{op.name} end", exc)

    def record_wait(self, op: CommOp, start_ns: int, end_ns: int) -> None:
        """A host span `<op>.wait`: the training thread blocked in wait() on `op` (CPU async ops).
        Same group, seq and peer as the op; the step and micro-batch are the waiter's (ambient)."""
        if not self.recording:
            return
        try:
            self._events.append((self.step, self.microbatch, self.chunk, op.name + WAIT_SUFFIX, "host",
                                 op.group_name, op.seq, op.peer, 0, start_ns, start_ns, end_ns))
        except Exception as exc:
            self._failed(f"{op.name} wait", exc)

    # -- steps, clocks, lifecycle ------------------------------------------------------------
    @property
    def dropped_events(self) -> int:
        dropped = sum(b.dropped for b in self.buffers.values())
        return dropped + (self.timeline.dropped if self.timeline is not None else 0)

    @property
    def write_errors(self) -> int:
        return self.flusher.write_errors if self.flusher is not None else 0

    def record_step(self, step: int | None = None, start_ns: int | None = None, end_ns: int | None = None,
                    tokens: int = 0, loss: float = math.nan, lr: float = math.nan,
                    grad_norm: float = math.nan, model_flops: float = math.nan) -> None:
        """One steps-table row. Times default to set_step() .. now on the aligned clock (tracer.now_ns)."""
        if not self.enabled:
            return
        try:
            if self.pending_works and self.completion is not None:  # set whenever works are pending
                self.completion.sweep()
            step = self.step if step is None else int(step)
            start_ns = self.step_start_ns if start_ns is None else int(start_ns)
            end_ns = self.now_ns() if end_ns is None else int(end_ns)
            self.buffers["steps"].append((step, start_ns, end_ns, int(tokens), float(loss), float(lr),
                                          float(grad_norm), float(model_flops), self.dropped_events))
            if self.host is not None:
                self._record_host(step)
            if self.summary is not None:
                self.summary.step(step, (end_ns - start_ns) / 1e9, float(model_flops))
        except Exception as exc:
            self._failed("record_step", exc)

    def _record_host(self, step: int) -> None:
        """The host_steps row of the window since the previous record_step (none on the first)."""
        try:
            row = self.host.delta(self.now_ns())  # type: ignore[union-attr]
            if row is not None:
                self.buffers["host_steps"].append((step, *row))
        except Exception as exc:
            self._failed("host sample", exc)

    def sync_clocks(self, group: ProcessGroup | None = None, rounds: int = 8) -> ClockSyncResult | None:
        """Collective: every rank of `group` (default world) calls it at the same point.
        Sets this rank's offset to rank 0; rank 0 stores all offsets in run.json."""
        try:
            result = estimate_offsets(self.clock, group, rounds)
            self.clock.set_offset(result.offsets_ns[self.rank], result.delays_ns[self.rank])
            self.last_sync = result
            if self.rank == min(result.offsets_ns) and self.run_dir is not None:
                self._store_offsets(result)
            return result
        except Exception as exc:
            self._failed("clock sync", exc)
            return None

    def _store_offsets(self, result: ClockSyncResult) -> None:
        fields = {"clock_offsets_ns": {str(r): v for r, v in result.offsets_ns.items()},
                  "clock_sync_delay_ns": {str(r): v for r, v in result.delays_ns.items()},
                  "clock_synced_at_ns": self.now_ns()}
        try:
            rundir.update_manifest(self.run_dir, **fields)  # type: ignore[arg-type]
        except FileNotFoundError:
            rundir.write_manifest(self.run_dir, fields)  # type: ignore[arg-type]

    def flush(self) -> None:
        """Write everything buffered now (normally the flusher thread does this)."""
        if self.flusher is not None:
            self.flusher.flush()

    def stats(self) -> dict[str, int]:
        return {"dropped_events": self.dropped_events, "write_errors": self.write_errors,
                "internal_errors": self.internal_errors,
                "inflight": len(self.registry.snapshot()),
                "edge_summary_errors": self.sink.errors if isinstance(self.sink, SummarizingSink) else 0,
                "watchdog_reports": self.watchdog.reports if self.watchdog is not None else 0}

    def close(self) -> None:
        """Stop the background threads and flush everything; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for part in (self.summary, self.cupti, self.nvml, self.watchdog, self.completion, self.timeline,
                     self.host, self.flusher):
            if part is not None:
                try:
                    part.close()
                except Exception as exc:
                    self._failed(f"closing {type(part).__name__}", exc)
        if self.dropped_events:
            log.warning("tracer: rank %d dropped %d events (buffer full: slow or failing disk)",
                        self.rank, self.dropped_events)
        try:
            self.sink.close()
        except Exception as exc:
            self._failed("closing the sink", exc)
