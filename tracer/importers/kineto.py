"""Import PyTorch profiler (Kineto) traces: one JSON or JSON.gz per rank, as `export_chrome_trace` or
`tensorboard_trace_handler` write them.

- rank, world size and process groups come from `distributedInfo` (rank also from the digits ending the
  file name); the 3D layout from the groups' strides or --dp/--tp/--pp (layout.py). A single trace with
  neither (a single-process job) is rank 0 of a world of 1, with a note;
- steps are the `ProfilerStep#N` annotations (N = the profiler's step number = the loop's step when the
  profiler starts with the loop). A trace without them (one profiled region, as Holistic Trace Analysis
  reads it) is imported as one step 0 spanning the main thread's ops, with a note;
- compute spans are painted from the main thread's ops (kineto_ops.paint): forward/backward from
  record_function annotations whose name says forward/backward, backward also from autograd's
  `evaluate_function` ops, optimizer from `Optimizer.step#...`, data wait from `enumerate(DataLoader)`,
  every other op counts as forward work;
- communication: `c10d::*` ops (and NCCL's `record_param_comms` with its process group, sizes and
  sequence number), ended at the backend's execution (`gloo:*`/`nccl:*` annotations) so a collective
  spans from its issue to its completion like the tracer's;
- GPU activity (kernel, gpu_memcpy, gpu_memset) goes to the kernels table with the host time of its
  launch, joined on the correlation id (kineto_gpu.py); NCCL/RCCL kernels are marked with their op and
  kind from one name table (comm_kernels.py), and a multi-rank GPU trace with none is warned about.

Bounded memory, whatever the size of a file: it is streamed (json_stream), files are read in parallel
processes (`jobs`), and what is kept of each event (steps, runs of ops per thread, comm ops, GPU
activity and launches) goes to the file's spool (spool.py: temporary Parquet parts). The rank is then
converted from its spool by DuckDB queries read back in sorted batches, one window of start times at
a time (spool.sorted_batches; spilling to disk under a memory limit): ops painted by a streaming
sweep, comm ops matched to their executions in one pass, rows flushed to the segment writer in
batches. What grows with the trace is on disk; in memory only the step table (24 bytes a step) and
the writer's buffer of `flush_rows` rows.
"""

from __future__ import annotations

import multiprocessing as mp
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from megascope.tracer.importers import kineto_comms as kc
from megascope.tracer.importers import kineto_ops as ko
from megascope.tracer.importers import spool as sp
from megascope.tracer.importers.json_stream import EVENTS_KEY, TraceJsonError, TraceJsonReader
from megascope.tracer.importers.kineto_gpu import (
    ACTIVITY,
    GPU_CATS,
    LAUNCH,
    LAUNCH_CATS,
    add_activity,
    add_launch,
    is_launch,
    write_kernels,
)
from megascope.tracer.importers.layout import layout_from_sizes
from megascope.tracer.importers.writer import ImportInputError, RunWriter
from megascope.tracer.layout import Layout

MERGE_GAP_NS = 1_000_000  # ops of one kind less than 1 ms apart are one span (Python overhead between them)
_TRAILING_DIGITS = re.compile(r"(\d+)(?:\.pt)?\.json(?:\.gz)?$|(\d+)$")
SPOOL_TABLES = {
    "step": pa.schema([("tid", pa.string()), ("number", pa.int64()), ("start", pa.int64()), ("end", pa.int64())]),
    "span": pa.schema([("tid", pa.string()), ("start", pa.int64()), ("end", pa.int64()), ("cls", pa.int8())]),
    "comm": kc.COMMS, "act": ACTIVITY, "launch": LAUNCH,
}
"""A file's spool: ProfilerStep#N annotations, runs of ops per thread (_ThreadRuns), comm ops, GPU
activity and launches (kineto_gpu)."""


@dataclass
class RankTrace:
    """What is kept of one file in memory: its metadata and counts; the rest is in its spool."""
    path: str
    meta: dict[str, Any] = field(default_factory=dict)
    events_read: int = 0
    spool: str | None = None
    """Temporary folder of the spooled tables (SPOOL_TABLES); None: nothing to spool."""
    gpu_activities: int = 0
    comm_kernels: int = 0
    """GPU kernels recognized as NCCL/RCCL communication (comm_kernels.py), counted while writing."""


class _ThreadRuns:
    """Per thread: merges runs of same-class events on the fly and skips events nested in a parent of
    the same or a higher class (the aten ops inside a backward function, ...)."""

    def __init__(self, emit: Callable[[int, int, int], None]) -> None:
        self.emit = emit
        self.run: list[int] | None = None  # [start, end, cls]
        self.cover_end, self.cover_cls = -1, -1

    def add(self, start: int, end: int, cls: int) -> None:
        if start < self.cover_end and cls <= self.cover_cls:
            return
        if start < self.cover_end:  # a higher class inside a parent (comm inside a forward annotation)
            self.emit(start, end, cls)
            return
        self.cover_end, self.cover_cls = end, cls
        run = self.run
        if run is not None and run[2] == cls and start - run[1] <= MERGE_GAP_NS:
            run[1] = max(run[1], end)
            return
        if run is not None:
            self.emit(run[0], run[1], run[2])
        self.run = [start, end, cls]

    def close(self) -> None:
        if self.run is not None:
            self.emit(self.run[0], self.run[1], self.run[2])
            self.run = None


def read_rank_trace(path: Path) -> RankTrace:
    """Stream one file into a RankTrace and its spool. Raises TraceJsonError / ImportInputError (and
    leaves no spool behind)."""
    trace = RankTrace(str(path))
    spool = sp.Spool(SPOOL_TABLES, prefix="megascope-kineto-")
    try:
        _read_events(path, trace, spool)
        trace.spool = spool.close()
    except BaseException:
        spool.discard()
        raise
    trace.gpu_activities = spool.rows["act"]
    return trace


def _span_emitter(spool: sp.Spool, tid: str) -> Callable[[int, int, int], None]:
    def emit(start: int, end: int, cls: int) -> None:
        spool.append("span", (tid, start, end, cls))
    return emit


def _read_events(path: Path, trace: RankTrace, spool: sp.Spool) -> None:
    threads: dict[str, _ThreadRuns] = {}
    comms = kc.CommLog(spool)
    seen_events = False
    for key, value in TraceJsonReader(path):
        if key != EVENTS_KEY:
            trace.meta[key] = value
            continue
        seen_events = True
        trace.events_read += 1
        if not isinstance(value, dict) or value.get("ph") != "X":
            continue
        name, cat = str(value.get("name", "")), value.get("cat", "")
        ts, dur = value.get("ts"), value.get("dur", 0)
        if not isinstance(ts, (int, float)):
            continue
        start = int(round(ts * 1000))
        end = start + int(round((dur or 0) * 1000))
        if cat in GPU_CATS:
            add_activity(spool, name, cat, value.get("args") or {}, start, end)
            continue
        if cat in LAUNCH_CATS:
            if is_launch(name):
                add_launch(spool, (value.get("args") or {}).get("correlation"), start)
            continue
        tid = str(value.get("tid"))
        step = ko.step_number(name) if cat == "user_annotation" else None
        if step is not None:
            spool.append("step", (tid, step, start, end))
            continue
        cls = ko.classify(name, cat)
        if cls is None:
            continue
        if cls == ko.COMM:
            comms.add(tid, start, end, name, value.get("args") or {})
        runs = threads.get(tid)
        if runs is None:
            runs = threads[tid] = _ThreadRuns(_span_emitter(spool, tid))
        runs.add(start, end, cls)
    if not seen_events:
        keys = ", ".join(list(trace.meta)[:6]) or "nothing"
        raise ImportInputError(f"{path} is not a PyTorch profiler trace: no traceEvents (found {keys}); "
                               "pass the JSON written by prof.export_chrome_trace or tensorboard_trace_handler")
    for runs in threads.values():
        runs.close()
    comms.close()


def rank_of(trace: RankTrace, single: bool = False) -> int | None:
    """The trace's rank: distributedInfo.rank, else the digits ending the file name. None when it has
    neither and is the only input (`single`): a single-process trace, rank 0 of a world of 1."""
    info = trace.meta.get("distributedInfo") or {}
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = _TRAILING_DIGITS.search(Path(trace.path).name)
    if m:
        return int(m.group(1) or m.group(2))
    if single and not info:
        return None
    raise ImportInputError(f"{trace.path}: no distributedInfo.rank and no rank at the end of the file name; "
                           "profile with torch.distributed initialized, or name the file like trace_rank3.json "
                           "(a single trace without them is imported as rank 0 of a world of 1)")


def _steps(con: Any, folder: str) -> tuple[ko.StepIndex, list[str], bool]:
    """The rank's steps (sorted by start), its main threads (those of the ProfilerStep annotations) and
    whether its profiled region had to be taken as one step 0 (no annotations: `_whole_region`)."""
    steps = sp.parts(folder, "step")
    if steps is not None:
        rows = con.execute('SELECT number, start, "end" FROM read_parquet($p) ORDER BY start', {"p": steps})
        index = ko.StepIndex(rows.fetchall())
        tids = [t for (t,) in con.execute("SELECT DISTINCT tid FROM read_parquet($p)", {"p": steps}).fetchall()]
        return index, tids, False
    index, tids = _whole_region(con, folder)
    return index, tids, bool(tids)


def _whole_region(con: Any, folder: str) -> tuple[ko.StepIndex, list[str]]:
    """A trace without ProfilerStep#N annotations: its profiled region is step 0, on the thread whose
    ops cover the most time (the training loop's); no steps and no thread when it has no ops at all."""
    spans, comms = sp.parts(folder, "span"), sp.parts(folder, "comm")
    if spans is None:
        return ko.StepIndex([]), []
    [(main,)] = con.execute('SELECT tid FROM read_parquet($p) GROUP BY tid ORDER BY sum("end" - start) DESC, '
                          "min(start) LIMIT 1", {"p": spans}).fetchall()
    both = 'SELECT start, "end" FROM read_parquet($spans) WHERE tid = $tid'
    if comms is not None:
        both += ' UNION ALL SELECT start, "end" FROM read_parquet($comms) WHERE tid = $tid'
    [(start, end)] = con.execute(f'SELECT min(start), max("end") FROM ({both})',
                                 {"spans": spans, "tid": main, **({"comms": comms} if comms else {})}).fetchall()
    return ko.StepIndex([(0, start, end)]), [main]


def _spans(con: Any, folder: str, tid: str, batch_rows: int = 8_192) -> Iterator[tuple[int, int, int]]:
    """One thread's runs of ops (start, end, class), sorted by start, in batches."""
    spans = sp.parts(folder, "span")
    if spans is None:
        return
    batches = sp.sorted_batches(con, 'start, "end", cls', "read_parquet($p)", "tid = $tid", "start",
                                {"p": spans, "tid": tid}, batch_rows)
    for batch in batches:
        yield from zip(*(batch.column(i).to_pylist() for i in range(3)))


# ---- conversion of one rank ----------------------------------------------------------------------
def convert_rank(trace: RankTrace, rank: int, layout: Layout, writer: RunWriter) -> bool:
    """Write one rank's steps, compute spans, comm events and GPU activity from its spool; returns whether
    its profiled region was taken as one step (no ProfilerStep#N annotations)."""
    folder = trace.spool
    if folder is None:
        raise _no_ops(trace)
    con = sp.connect(folder)
    try:
        index, main_tids, one_step = _steps(con, folder)
        if not len(index) or not main_tids:
            raise _no_ops(trace)
        base = int(trace.meta.get("baseTimeNanoseconds") or 0)
        for number, start, end in index:
            writer.step(rank, number, base + start, base + end)
        outside = _write_spans(con, folder, main_tids, index, rank, base, writer)
        comms = sp.parts(folder, "comm")
        if comms is not None:
            outside += _write_comms(kc.rows(con, comms, main_tids), index, rank, base, layout, writer)
        if outside:
            writer.warn(f"rank {rank}: {outside} span(s) outside every ProfilerStep were left out")
        if trace.gpu_activities:
            _write_gpu(con, trace, rank, base, index, layout, writer)
    finally:
        con.close()
    writer.flush_rank(rank)
    return one_step


def _no_ops(trace: RankTrace) -> ImportInputError:
    return ImportInputError(f"{trace.path}: no ProfilerStep#N annotations and no CPU ops to import; pass "
                            "a trace of the training loop (torch.profiler with ProfilerActivity.CPU)")


def _write_spans(con: Any, folder: str, main_tids: list[str], index: ko.StepIndex, rank: int, base: int,
                 writer: RunWriter) -> int:
    """The main threads' ops painted into compute spans, cut at step boundaries; returns the spans
    outside every step."""
    outside = 0
    for tid in main_tids:
        for start, end, cls in ko.paint(_spans(con, folder, tid), MERGE_GAP_NS):
            pieces = index.split(start, end)
            outside += not pieces
            name, kind = ko.SPAN_NAMES[cls]
            for step, lo, hi in pieces:
                writer.event(rank, step, name, kind, base + lo, base + hi)
    return outside


def _write_comms(ops: Iterator[kc.Comm], index: ko.StepIndex, rank: int, base: int, layout: Layout,
                 writer: RunWriter) -> int:
    """The issued comm ops, ended at their executions, as collective/p2p events; returns those outside
    every step."""
    counters: Counter = Counter()
    default_group = _default_group(layout)
    outside = 0
    for op in kc.match_executions(ops):
        op_step = index.at(op.start)
        if op_step is None:
            outside += 1
            continue
        nbytes = (op.numel or 0) * (op.elem_bytes or 4)
        if op.name in ("send", "recv"):
            peer = _global_peer(op, rank, layout)
            name = _p2p_name(op.name, rank, peer, layout)
            key = (op.name, peer)
            writer.event(rank, op_step, name, "p2p", base + op.start, base + op.end, group="pp" if layout.pp > 1 else
                         default_group, seq=counters[key], peer=peer, nbytes=nbytes)
            counters[key] += 1
            continue
        group = layout.group_name(op.group_ranks) if op.group_ranks else default_group
        group = group or "world"
        seq = op.seq if op.seq is not None else counters[group]
        counters[group] += 1
        writer.event(rank, op_step, op.name, "collective", base + op.start, base + op.end, group=group, seq=seq,
                     nbytes=nbytes)
    return outside


def _write_gpu(con: Any, trace: RankTrace, rank: int, base: int, index: ko.StepIndex, layout: Layout,
               writer: RunWriter) -> None:
    assert trace.spool is not None
    kernels, unlaunched, comm = write_kernels(con, trace.spool, rank, base, index, writer)
    trace.comm_kernels = comm
    if unlaunched:
        writer.warn(f"rank {rank}: {unlaunched} of {kernels} GPU activities have no launching runtime call "
                    "in the trace (launch_ns = -1)")
    if not comm and layout.world > 1:
        writer.warn(f"rank {rank}: none of its {kernels} GPU activities is a known NCCL/RCCL communication "
                    "kernel (ncclDevKernel_*, ncclKernel_*, ...; tracer/importers/comm_kernels.py), so its "
                    "collectives have no GPU side; profile with ProfilerActivity.CUDA while the job "
                    "communicates, or add its kernels' names to that table")


def _default_group(layout: Layout) -> str:
    """Gloo traces do not say which process group ran a collective: when one kind of group is larger
    than 1 it can only be that one (dp for a plain data-parallel job)."""
    nontrivial = [n for n, size in (("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp)) if size > 1]
    return nontrivial[0] if len(nontrivial) == 1 else ("dp" if not nontrivial else "")


def _global_peer(op: kc.Comm, rank: int, layout: Layout) -> int:
    local = op.peer_local if op.peer_local is not None else -1
    if local < 0:
        return -1
    if layout.pp > 1:  # pipeline transfers run on the pp group: its local ranks are stage indices
        group = layout.group_of("pp", rank)
        return group[local] if local < len(group) else local
    return local


def _p2p_name(kind: str, rank: int, peer: int, layout: Layout) -> str:
    if peer < 0:
        return kind
    ahead = layout.coords(peer)[0] > layout.coords(rank)[0] if layout.pp > 1 else peer > rank
    if kind == "send":
        return "send_forward" if ahead else "send_backward"
    return "recv_backward" if ahead else "recv_forward"


# ---- the whole import ----------------------------------------------------------------------------
def _read_safely(path: Path) -> RankTrace | str:
    try:
        return read_rank_trace(path)
    except (TraceJsonError, ImportInputError, OSError, EOFError, UnicodeDecodeError) as exc:
        return f"{path}: {exc}" if str(path) not in str(exc) else str(exc)


def import_kineto(paths: list[Path], writer: RunWriter, dp: int | None, tp: int | None, pp: int | None,
                  vpp: int | None, jobs: int = 1) -> tuple[Layout, list[int], dict[int, str], list[str]]:
    failed: list[str] = []
    hosts: dict[int, str] = {}
    done: dict[int, str] = {}
    one_step: list[int] = []
    layout: Layout | None = None
    pool = mp.get_context("spawn").Pool(jobs) if jobs > 1 and len(paths) > 1 else None
    results: Any = iter(())
    try:
        results = pool.imap(_read_safely, paths) if pool else (_read_safely(p) for p in paths)
        for path, trace in zip(paths, results):
            if isinstance(trace, str):
                writer.warn(trace)
                failed.append(str(path))
                writer.input_done()
                continue
            try:
                rank = _rank(trace, len(paths) == 1, writer)
                if rank in done:
                    raise ImportInputError(f"{path} and {done[rank]} are both rank {rank}; pass one trace per rank")
                layout = layout or _layout(trace, dp, tp, pp, vpp)
                if rank >= layout.world:
                    raise ImportInputError(f"{path} is rank {rank}, outside the world of {layout.world}")
                if convert_rank(trace, rank, layout, writer):
                    one_step.append(rank)
            except ImportInputError as exc:
                if "both rank" in str(exc):
                    raise
                writer.warn(str(exc))
                failed.append(str(path))
                writer.input_done()
                continue
            finally:
                sp.remove(trace.spool)
            done[rank] = str(path)
            hosts[rank] = str(trace.meta.get("host_name") or "unknown")
            writer.add_source(path, kind="kineto trace", rank=rank, events=trace.events_read,
                              gpu_activities=trace.gpu_activities, comm_kernels=trace.comm_kernels,
                              one_step=rank in one_step)
    finally:
        if pool:
            pool.close()
            for rest in results:  # stopped early (an error): the unread traces' spools
                if isinstance(rest, RankTrace):
                    sp.remove(rest.spool)
            pool.join()
    if one_step:
        listed = ", ".join(map(str, sorted(one_step)[:16]))
        writer.note(f"no ProfilerStep#N annotations in the trace of rank(s) {listed}"
                    f"{' ...' if len(one_step) > 16 else ''}: each profiled region was imported as one step (step 0); "
                    "for per-step analysis profile with torch.profiler.schedule(...) and call prof.step() every step")
    if layout is None:
        return Layout(1, 1, 1), [], hosts, failed
    missing = sorted(set(range(layout.world)) - set(done))
    if missing:
        writer.warn(f"no trace for rank(s) {', '.join(map(str, missing[:16]))}{' ...' if len(missing) > 16 else ''}"
                    f" of {layout.world}; the other ranks were imported")
    return layout, sorted(done), hosts, failed


def _rank(trace: RankTrace, single: bool, writer: RunWriter) -> int:
    rank = rank_of(trace, single)
    if rank is None:
        writer.note(f"{trace.path} has no distributedInfo and no rank in its file name: imported as rank 0 of a "
                    "world of 1 (a single-process trace)")
        return 0
    return rank


def _layout(trace: RankTrace, dp: int | None, tp: int | None, pp: int | None, vpp: int | None) -> Layout:
    info = trace.meta.get("distributedInfo") or {}
    world = info.get("world_size")
    if not isinstance(world, int):
        world = (dp or 1) * (tp or 1) * (pp or 1)
    groups = [kc.parse_ranks(g.get("ranks")) or [] for g in info.get("pg_config") or [] if isinstance(g, dict)]
    try:
        return layout_from_sizes(world, dp, tp, pp, vpp, groups)
    except ValueError as exc:
        raise ImportInputError(f"{trace.path}: {exc}") from None

