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

Files are streamed (json_stream) one rank per process (`jobs`), each writing its own rank's segments:
memory is bounded by the per-thread runs of ops, not by the file size.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascope.tracer.importers import kineto_ops as ko
from megascope.tracer.importers.json_stream import EVENTS_KEY, TraceJsonError, TraceJsonReader
from megascope.tracer.importers.kineto_gpu import (
    GPU_CATS,
    LAUNCH_CATS,
    GpuSpool,
    is_launch,
    remove_spool,
    write_kernels,
)
from megascope.tracer.importers.layout import layout_from_sizes
from megascope.tracer.importers.writer import ImportInputError, RunWriter
from megascope.tracer.layout import Layout

MERGE_GAP_NS = 1_000_000  # ops of one kind less than 1 ms apart are one span (Python overhead between them)
_TRAILING_DIGITS = re.compile(r"(\d+)(?:\.pt)?\.json(?:\.gz)?$|(\d+)$")


@dataclass(slots=True)  # one per communication op of the file: kept small
class _Comm:
    tid: Any
    start: int
    end: int
    name: str            # our name: all_reduce, send, ...
    raw: str
    numel: int | None = None
    elem_bytes: int | None = None
    peer_local: int | None = None
    group_ranks: list[int] | None = None
    seq: int | None = None


@dataclass
class RankTrace:
    """Everything kept from one file: small, whatever the file size."""
    path: str
    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    intervals: dict[Any, list[tuple[int, int, int]]] = field(default_factory=lambda: defaultdict(list))
    comms: list[_Comm] = field(default_factory=list)
    events_read: int = 0
    gpu_spool: str | None = None
    """Temporary folder of the spooled GPU activity and launches (None: none in the file)."""
    gpu_activities: int = 0
    comm_kernels: int = 0
    """GPU kernels recognized as NCCL/RCCL communication (comm_kernels.py), counted while writing."""


class _ThreadRuns:
    """Per thread: merges runs of same-class events on the fly and skips events nested in a parent of
    the same or a higher class (the aten ops inside a backward function, ...)."""

    def __init__(self, out: list[tuple[int, int, int]]) -> None:
        self.out = out
        self.run: list[int] | None = None  # [start, end, cls]
        self.cover_end, self.cover_cls = -1, -1

    def add(self, start: int, end: int, cls: int) -> None:
        if start < self.cover_end and cls <= self.cover_cls:
            return
        if start < self.cover_end:  # a higher class inside a parent (comm inside a forward annotation)
            self.out.append((start, end, cls))
            return
        self.cover_end, self.cover_cls = end, cls
        run = self.run
        if run is not None and run[2] == cls and start - run[1] <= MERGE_GAP_NS:
            run[1] = max(run[1], end)
            return
        if run is not None:
            self.out.append((run[0], run[1], run[2]))
        self.run = [start, end, cls]

    def close(self) -> None:
        if self.run is not None:
            self.out.append((self.run[0], self.run[1], self.run[2]))
            self.run = None


def read_rank_trace(path: Path) -> RankTrace:
    """Stream one file into a RankTrace. Raises TraceJsonError / ImportInputError."""
    trace = RankTrace(str(path))
    spool = GpuSpool()
    try:
        _read_events(path, trace, spool)
    except BaseException:
        spool.discard()
        raise
    trace.gpu_spool = spool.close()
    trace.gpu_activities = spool.activities
    return trace


def _read_events(path: Path, trace: RankTrace, spool: GpuSpool) -> None:
    threads: dict[Any, _ThreadRuns] = {}
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
            spool.activity(name, cat, value.get("args") or {}, start, end)
            continue
        if cat in LAUNCH_CATS:
            if is_launch(name):
                spool.launch((value.get("args") or {}).get("correlation"), start)
            continue
        tid = value.get("tid")
        step = ko.step_number(name) if cat == "user_annotation" else None
        if step is not None:
            trace.steps.append((step, start, end))
            trace.meta.setdefault("_main_tids", set()).add(tid)
            continue
        cls = ko.classify(name, cat)
        if cls is None:
            continue
        if cls == ko.COMM:
            _add_comm(trace, tid, start, end, name, value.get("args") or {})
        runs = threads.get(tid)
        if runs is None:
            runs = threads[tid] = _ThreadRuns(trace.intervals[tid])
        runs.add(start, end, cls)
    if not seen_events:
        keys = ", ".join(list(trace.meta)[:6]) or "nothing"
        raise ImportInputError(f"{path} is not a PyTorch profiler trace: no traceEvents (found {keys}); "
                               "pass the JSON written by prof.export_chrome_trace or tensorboard_trace_handler")
    for runs in threads.values():
        runs.close()


def _add_comm(trace: RankTrace, tid: Any, start: int, end: int, raw: str, args: dict) -> None:
    if raw == "record_param_comms":  # NCCL metadata: attach to the c10d op it sits in
        parent = next((c for c in reversed(trace.comms[-4:]) if c.tid == tid and c.start <= start <= c.end), None)
        name = ko.comm_name(str(args.get("Collective name", "")))
        target = parent or _Comm(tid, start, end, name or "unknown", raw)
        if parent is None and name is None:
            return
        target.numel = int(args.get("In msg nelems") or args.get("In msg size") or 0) or target.numel
        target.elem_bytes = ko.dtype_bytes(args.get("dtype")) or target.elem_bytes
        target.group_ranks = _ranks(args.get("Process Group Ranks")) or target.group_ranks
        seq = args.get("Seq") if args.get("Seq") is not None else args.get("seq")
        target.seq = int(seq) if isinstance(seq, (int, float)) else target.seq
        if parent is None:
            trace.comms.append(target)
        return
    name = ko.comm_name(raw)
    if name is None:
        return
    comm = _Comm(tid, start, end, name, raw, numel=ko.numel(args.get("Input Dims")),
                 elem_bytes=ko.dtype_bytes(args.get("Input type")))
    if name in ("send", "recv") and raw.startswith("c10d::"):
        concrete = args.get("Concrete Inputs") or []
        if len(concrete) > 2 and str(concrete[2]).lstrip("-").isdigit():
            comm.peer_local = int(concrete[2])
    trace.comms.append(comm)


def _ranks(value: Any) -> list[int] | None:
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return None
    return [int(r) for r in value] if isinstance(value, (list, tuple)) and value else None


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


def whole_region_step(trace: RankTrace) -> bool:
    """A trace without ProfilerStep#N annotations: make its profiled region step 0, on the thread
    whose ops cover the most time (the training loop's); False when it has no ops at all."""
    busy = {tid: sum(e - s for s, e, _ in spans) for tid, spans in trace.intervals.items() if spans}
    if not busy:
        return False
    main = max(busy, key=lambda tid: busy[tid])
    spans = trace.intervals[main]
    issued = [c for c in trace.comms if c.tid == main]
    start = min([s for s, _, _ in spans] + [c.start for c in issued])
    end = max([e for _, e, _ in spans] + [c.end for c in issued])
    trace.steps = [(0, start, end)]
    trace.meta["_main_tids"] = {main}
    return True


# ---- conversion of one rank ----------------------------------------------------------------------
def convert_rank(trace: RankTrace, rank: int, layout: Layout, writer: RunWriter) -> int:
    """Write one rank's steps, compute spans and comm events; returns the number of events written."""
    base = int(trace.meta.get("baseTimeNanoseconds") or 0)
    main_tids = trace.meta.get("_main_tids") or set()
    if not trace.steps or not main_tids:
        raise ImportInputError(f"{trace.path}: no ProfilerStep#N annotations and no CPU ops to import; pass "
                               "a trace of the training loop (torch.profiler with ProfilerActivity.CPU)")
    index = ko.StepIndex(trace.steps)
    for number, start, end in sorted(trace.steps):
        writer.step(rank, number, base + start, base + end)
    written = outside = 0
    for tid in main_tids:
        for start, end, cls in ko.paint(trace.intervals.get(tid, []), MERGE_GAP_NS):
            pieces = index.split(start, end)
            outside += not pieces
            name, kind = ko.SPAN_NAMES[cls]
            for step, lo, hi in pieces:
                writer.event(rank, step, name, kind, base + lo, base + hi)
                written += 1
    ops = _matched_comms(trace, main_tids)
    counters: Counter = Counter()
    default_group = _default_group(layout)
    for op in ops:
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
        written += 1
    if outside:
        writer.warn(f"rank {rank}: {outside} span(s) outside every ProfilerStep were left out")
    if trace.gpu_spool:
        kernels, unlaunched, comm = write_kernels(trace.gpu_spool, rank, base, trace.steps, writer)
        trace.comm_kernels = comm
        if unlaunched:
            writer.warn(f"rank {rank}: {unlaunched} of {kernels} GPU activities have no launching runtime call "
                        "in the trace (launch_ns = -1)")
        if not comm and layout.world > 1:
            writer.warn(f"rank {rank}: none of its {kernels} GPU activities is a known NCCL/RCCL communication "
                        "kernel (ncclDevKernel_*, ncclKernel_*, ...; tracer/importers/comm_kernels.py), so its "
                        "collectives have no GPU side; profile with ProfilerActivity.CUDA while the job "
                        "communicates, or add its kernels' names to that table")
    writer.flush_rank(rank)
    return written


def _matched_comms(trace: RankTrace, main_tids: set) -> list[_Comm]:
    """Issued ops (c10d::*, record_param_comms on the main thread), each ended at its backend execution
    (gloo:*/nccl:* annotation of the same op and size, first come first served)."""
    issued = sorted((c for c in trace.comms if c.tid in main_tids and not c.raw.startswith(("gloo:", "nccl:"))),
                    key=lambda c: c.start)
    executed = sorted((c for c in trace.comms if c.raw.startswith(("gloo:", "nccl:"))), key=lambda c: c.start)
    pending: dict[str, list[_Comm]] = defaultdict(list)
    for op in issued:
        pending[op.name].append(op)
    for ex in executed:
        queue = pending.get(ex.name, [])
        for i, op in enumerate(queue[:16]):
            if op.start <= ex.start + 1000 and (op.numel is None or ex.numel is None or op.numel == ex.numel):
                op.end = max(op.end, ex.end)
                op.numel = op.numel or ex.numel
                op.elem_bytes = op.elem_bytes or ex.elem_bytes
                del queue[i]
                break
    return issued


def _default_group(layout: Layout) -> str:
    """Gloo traces do not say which process group ran a collective: when one kind of group is larger
    than 1 it can only be that one (dp for a plain data-parallel job)."""
    nontrivial = [n for n, size in (("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp)) if size > 1]
    return nontrivial[0] if len(nontrivial) == 1 else ("dp" if not nontrivial else "")


def _global_peer(op: _Comm, rank: int, layout: Layout) -> int:
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
                if not trace.steps and whole_region_step(trace):
                    one_step.append(rank)
                convert_rank(trace, rank, layout, writer)
            except ImportInputError as exc:
                if "both rank" in str(exc):
                    raise
                writer.warn(str(exc))
                failed.append(str(path))
                writer.input_done()
                continue
            finally:
                remove_spool(trace.gpu_spool)
            done[rank] = str(path)
            hosts[rank] = str(trace.meta.get("host_name") or "unknown")
            writer.add_source(path, kind="kineto trace", rank=rank, events=trace.events_read,
                              gpu_activities=trace.gpu_activities, comm_kernels=trace.comm_kernels,
                              one_step=rank in one_step)
    finally:
        if pool:
            pool.close()
            for rest in results:  # stopped early (an error): the unread traces' GPU spools
                if isinstance(rest, RankTrace):
                    remove_spool(rest.gpu_spool)
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
    groups = [_ranks(g.get("ranks")) or [] for g in info.get("pg_config") or [] if isinstance(g, dict)]
    try:
        return layout_from_sizes(world, dp, tp, pp, vpp, groups)
    except ValueError as exc:
        raise ImportInputError(f"{trace.path}: {exc}") from None

