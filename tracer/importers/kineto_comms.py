"""Communication ops of a Kineto trace, in bounded memory: read into the file's spool (`CommLog`) and
matched back, issue to execution, as one stream sorted by start (`match_executions`).

- issued: `c10d::*` ops and NCCL's `record_param_comms` (with its process group, sizes and sequence
  number) on the main thread; `record_param_comms` follows the c10d op it sits in, so the last few ops
  stay in memory to be completed by it before they are spooled;
- executed: the backend's `gloo:*` / `nccl:*` annotations (any thread); each ends the first of the
  first 16 pending issued ops of its name that started before it (within 1 us) with the same size.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import pyarrow as pa

from megascope.tracer.importers import kineto_ops as ko
from megascope.tracer.importers.spool import Spool, sorted_batches

COMMS = pa.schema([("ord", pa.int64()), ("tid", pa.string()), ("start", pa.int64()), ("end", pa.int64()),
                   ("name", pa.string()), ("raw", pa.string()), ("numel", pa.int64()),
                   ("elem_bytes", pa.int64()), ("peer_local", pa.int64()),
                   ("group_ranks", pa.list_(pa.int64())), ("seq", pa.int64())])
"""The spool's `comm` table: one row per op, `ord` its place in the file (ties of start keep file order)."""
KEEP_RECENT = 4
"""Ops kept in memory while reading, for a record_param_comms to complete its c10d op."""
PENDING_MAX = 4096
"""Issued ops held while matching; beyond it the oldest is written unmatched (ended at its own end)."""
EXECUTION_SLACK_NS = 1000
"""An execution may start this much before the op that issued it (clock granularity of the trace)."""


@dataclass(slots=True)  # one per communication op in flight: kept small
class Comm:
    tid: str
    start: int
    end: int
    name: str            # our name: all_reduce, send, ...
    raw: str
    numel: int | None = None
    elem_bytes: int | None = None
    peer_local: int | None = None
    group_ranks: list[int] | None = None
    seq: int | None = None
    matched: bool = False

    @property
    def executed(self) -> bool:
        return self.raw.startswith(("gloo:", "nccl:"))


class CommLog:
    """Comm ops in file order into the spool's `comm` table, the last KEEP_RECENT held back."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.recent: deque[Comm] = deque()
        self.count = 0

    def add(self, tid: str, start: int, end: int, raw: str, args: dict) -> None:
        """One COMM-class event (c10d op, record_param_comms, gloo:/nccl: annotation)."""
        if raw == "record_param_comms":  # NCCL metadata: attach to the c10d op it sits in
            self._param_comms(tid, start, end, args)
            return
        name = ko.comm_name(raw)
        if name is None:
            return
        comm = Comm(tid, start, end, name, raw, numel=ko.numel(args.get("Input Dims")),
                    elem_bytes=ko.dtype_bytes(args.get("Input type")))
        if name in ("send", "recv") and raw.startswith("c10d::"):
            concrete = args.get("Concrete Inputs") or []
            if len(concrete) > 2 and str(concrete[2]).lstrip("-").isdigit():
                comm.peer_local = int(concrete[2])
        self._push(comm)

    def _param_comms(self, tid: str, start: int, end: int, args: dict) -> None:
        parent = next((c for c in reversed(self.recent) if c.tid == tid and c.start <= start <= c.end), None)
        name = ko.comm_name(str(args.get("Collective name", "")))
        if parent is None and name is None:
            return
        target = parent or Comm(tid, start, end, name or "unknown", "record_param_comms")
        target.numel = int(args.get("In msg nelems") or args.get("In msg size") or 0) or target.numel
        target.elem_bytes = ko.dtype_bytes(args.get("dtype")) or target.elem_bytes
        target.group_ranks = parse_ranks(args.get("Process Group Ranks")) or target.group_ranks
        seq = args.get("Seq") if args.get("Seq") is not None else args.get("seq")
        target.seq = int(seq) if isinstance(seq, (int, float)) else target.seq
        if parent is None:
            self._push(target)

    def _push(self, comm: Comm) -> None:
        if len(self.recent) >= KEEP_RECENT:
            self._spool(self.recent.popleft())
        self.recent.append(comm)

    def _spool(self, c: Comm) -> None:
        self.spool.append("comm", (self.count, c.tid, c.start, c.end, c.name, c.raw, c.numel, c.elem_bytes,
                                   c.peer_local, c.group_ranks, c.seq))
        self.count += 1

    def close(self) -> None:
        while self.recent:
            self._spool(self.recent.popleft())


def parse_ranks(value: Any) -> list[int] | None:
    """A process group's ranks as Kineto writes them: a list, or its text ('[0, 1, 2]')."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return None
    return [int(r) for r in value] if isinstance(value, (list, tuple)) and value else None


# ---- reading back ------------------------------------------------------------------------------
COLUMNS = 'tid, start, "end", name, raw, numel, elem_bytes, peer_local, group_ranks, seq'
"""The spooled ops' columns, in Comm's field order."""
THAT_MATTER = "raw LIKE 'gloo:%' OR raw LIKE 'nccl:%' OR list_contains($main_tids, tid)"
"""The ops that matter to a rank: executions on any thread, issues on the main threads."""


def rows(con: Any, comms: str, main_tids: list[str], batch_rows: int = 8_192) -> Iterator[Comm]:
    """The spooled ops that matter, as Comm, by start (file order among equal starts), in batches."""
    batches = sorted_batches(con, COLUMNS, "read_parquet($comms)", THAT_MATTER, "start, ord",
                                {"comms": comms, "main_tids": main_tids}, batch_rows)
    for batch in batches:
        for r in zip(*(batch.column(i).to_pylist() for i in range(batch.num_columns))):
            yield Comm(*r)


def match_executions(ops: Iterable[Comm]) -> Iterator[Comm]:
    """Issued ops, in start order, each ended at its execution (module docstring), from `ops` sorted by
    start. Holds at most PENDING_MAX issued ops and the executions of the last EXECUTION_SLACK_NS."""
    order: deque[Comm] = deque()  # issued, not yet yielded
    pending: dict[str, deque[Comm]] = defaultdict(deque)  # issued and unmatched, per name
    waiting: deque[Comm] = deque()  # executions until every op that may match them has been seen
    for op in ops:
        while waiting and waiting[0].start + EXECUTION_SLACK_NS < op.start:
            _match(waiting.popleft(), pending)
        if op.executed:
            waiting.append(op)
            continue
        order.append(op)
        pending[op.name].append(op)
        while order and (order[0].matched or len(order) > PENDING_MAX):
            head = order.popleft()
            if not head.matched:  # the oldest of its name too: first in its queue
                queue = pending[head.name]
                queue.popleft() if queue[0] is head else queue.remove(head)
            yield head
    while waiting:
        _match(waiting.popleft(), pending)
    yield from order


def _match(ex: Comm, pending: dict[str, deque[Comm]]) -> None:
    queue = pending.get(ex.name)
    if not queue:
        return
    for i, op in enumerate(islice(queue, 16)):
        if op.start <= ex.start + EXECUTION_SLACK_NS and (op.numel is None or ex.numel is None
                                                         or op.numel == ex.numel):
            op.end = max(op.end, ex.end)
            op.numel = op.numel or ex.numel
            op.elem_bytes = op.elem_bytes or ex.elem_bytes
            op.matched = True
            del queue[i]
            return
