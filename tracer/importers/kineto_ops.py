"""What a Kineto (PyTorch profiler) event means to us: its class (step marker, communication,
optimizer, backward, forward annotation, data loading, plain op), our name for a communication op,
its payload bytes, and the painting of a rank's thread into forward/backward/optimizer spans.

Painting: every classified interval of the main thread is laid on the timeline and each instant takes
the highest-priority class covering it (comm > data > optimizer > backward > forward annotation >
plain op, which counts as forward). Runs of one class separated by less than `merge_gap_ns` of
unclassified time join into one span, so a forward pass is one span like the tracer's, not 500 ops.
"""

from __future__ import annotations

import heapq
import re
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator

import numpy as np

# classes, in painting priority order (higher wins)
OP, FWD, BWD, OPTIM, DATA, COMM = range(6)
SPAN_NAMES = {OP: ("forward", "compute"), FWD: ("forward", "compute"), BWD: ("backward", "compute"),
              OPTIM: ("optimizer", "compute"), DATA: ("data_wait", "host")}

_FWD_ANNOTATION = re.compile(r"(^|[#\s:_\-/.])(forward|fwd)([#\s:_\-/.]|$)", re.I)
_BWD_ANNOTATION = re.compile(r"(^|[#\s:_\-/.])(backward|bwd)([#\s:_\-/.]|$)", re.I)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")

# c10d op / backend annotation (after the 'nccl:' or 'gloo:' prefix) -> our collective name
COMM_NAMES = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "allreduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather": "all_gather", "_allgather_base": "all_gather", "allgather": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "broadcast_": "broadcast", "broadcast": "broadcast", "barrier": "barrier",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all": "all_to_all",
    "alltoall_base": "all_to_all", "alltoall": "all_to_all",
    "reduce_": "reduce", "reduce": "reduce", "gather_": "gather", "gather": "gather",
    "scatter_": "scatter", "scatter": "scatter",
    "send": "send", "recv_": "recv", "recv": "recv", "recv_any_source_": "recv",
}
DTYPE_BYTES = {"float": 4, "float32": 4, "c10::half": 2, "half": 2, "float16": 2, "c10::bfloat16": 2,
               "bfloat16": 2, "double": 8, "float64": 8, "long int": 8, "int64": 8, "long": 8, "int": 4,
               "int32": 4, "short int": 2, "int16": 2, "unsigned char": 1, "signed char": 1, "bool": 1,
               "uint8": 1, "int8": 1, "byte": 1, "char": 1}


def classify(name: str, cat: str) -> int | None:
    """The class of one complete ('X') event; None for events we skip."""
    if cat == "cpu_op":
        if name.startswith("c10d::") or name == "record_param_comms":
            return COMM
        if name.startswith("autograd::engine::evaluate_function"):
            return BWD
        return OP
    if cat == "user_annotation":
        if name.startswith(("nccl:", "gloo:")):
            return COMM
        if name.startswith("Optimizer."):
            return OPTIM
        if name.startswith("enumerate(DataLoader)"):
            return DATA
        if name.startswith("ProfilerStep#"):
            return None
        if _BWD_ANNOTATION.search(name):
            return BWD
        if _FWD_ANNOTATION.search(name):
            return FWD
    return None


def step_number(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def comm_name(name: str) -> str | None:
    """Our op name for 'c10d::allreduce_', 'nccl:all_reduce', 'gloo:all_reduce', ... (None: not comm)."""
    base = name.split("::", 1)[1] if name.startswith("c10d::") else name.split(":", 1)[-1]
    return COMM_NAMES.get(base.strip().lower())


def numel(dims: object) -> int | None:
    """Elements of the first tensor (or tensor list) in a Kineto 'Input Dims' value."""
    if not isinstance(dims, list) or not dims:
        return None
    first = dims[0]
    if isinstance(first, list) and first and isinstance(first[0], list):  # a TensorList
        return sum(_prod(t) for t in first if isinstance(t, list))
    if isinstance(first, list):
        return _prod(first) if first else None
    return None


def _prod(shape: list) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def dtype_bytes(value: object) -> int | None:
    if isinstance(value, list):
        value = next((v for v in value if isinstance(v, str) and v), None)
    if not isinstance(value, str) or not value:
        return None
    return DTYPE_BYTES.get(value.strip().lower())


def paint(intervals: Iterable[tuple[int, int, int]], merge_gap_ns: int) -> Iterator[tuple[int, int, int]]:
    """(start, end, class) intervals, sorted by start -> non-overlapping spans (start, end, class), highest
    class wins, same-class runs joined across gaps shorter than merge_gap_ns. COMM spans are left out (comm
    ops are events of their own). Streams: each span is yielded once final, and memory holds only the
    intervals open at an instant (a min-heap of their ends), whatever the number of intervals."""
    painter = _Painter(merge_gap_ns)
    open_ends: list[tuple[int, int]] = []
    for start, end, cls in intervals:
        if end <= start:
            continue
        while open_ends and open_ends[0][0] <= start:  # ends before starts at the same instant
            t, closing = heapq.heappop(open_ends)
            yield from painter.point(t, -1, closing)
        yield from painter.point(start, 1, cls)
        heapq.heappush(open_ends, (end, cls))
    while open_ends:
        t, closing = heapq.heappop(open_ends)
        yield from painter.point(t, -1, closing)
    yield from painter.close()


class _Painter:
    """The sweep of `paint`: counts of open intervals per class, the top class since `since`, and the
    span being extended (`last`), yielded when a span of another class or beyond the gap follows."""

    def __init__(self, merge_gap_ns: int) -> None:
        self.merge_gap_ns = merge_gap_ns
        self.counts = [0] * 6
        self.current, self.since = -1, 0
        self.last: list[int] | None = None

    def point(self, t: int, delta: int, cls: int) -> Iterator[tuple[int, int, int]]:
        top_before = self.current
        self.counts[cls] += delta
        self.current = max((c for c in range(5, -1, -1) if self.counts[c] > 0), default=-1)
        if self.current != top_before:
            if top_before >= 0 and t > self.since:
                yield from self._append(self.since, t, top_before)
            self.since = t

    def _append(self, start: int, end: int, cls: int) -> Iterator[tuple[int, int, int]]:
        same = cls if cls != OP else FWD  # plain ops are forward work: they join forward annotations
        last = self.last
        if last is not None and last[2] == same and start - last[1] <= self.merge_gap_ns:
            last[1] = end
            return
        if last is not None and last[2] != COMM:
            yield last[0], last[1], last[2]
        self.last = [start, end, same]

    def close(self) -> Iterator[tuple[int, int, int]]:
        if self.last is not None and self.last[2] != COMM:
            yield self.last[0], self.last[1], self.last[2]
        self.last = None


class StepIndex:
    """Which ProfilerStep#N an instant falls in (None outside every step). Steps are kept in three
    int64 arrays (24 bytes a step), the only per-rank state that grows with the trace's length."""

    def __init__(self, steps: Iterable[tuple[int, int, int]]) -> None:
        """`steps`: (number, start, end), sorted by start."""
        self.numbers, self.starts, self.ends = array("q"), array("q"), array("q")
        for number, start, end in steps:
            self.numbers.append(number)
            self.starts.append(start)
            self.ends.append(end)

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(self.numbers, self.starts, self.ends)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """numbers, starts, ends as numpy views (no copy)."""
        return (np.frombuffer(self.numbers, dtype=np.int64), np.frombuffer(self.starts, dtype=np.int64),
                np.frombuffer(self.ends, dtype=np.int64))

    def split(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(step, start, end) pieces of [start, end) cut at step boundaries (a span painted across the
        end of one step and the start of the next is two spans, as the tracer would have recorded)."""
        i = max(0, bisect_right(self.starts, start) - 1)
        out = []
        while i < len(self.starts) and self.starts[i] < end:
            lo, hi = max(start, self.starts[i]), min(end, self.ends[i])
            if hi > lo:
                out.append((self.numbers[i], lo, hi))
            i += 1
        return out

    def at(self, t: int) -> int | None:
        i = bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.ends[i]:
            return self.numbers[i]
        return None
