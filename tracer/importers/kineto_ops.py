"""What a Kineto (PyTorch profiler) event means to us: its class (step marker, communication,
optimizer, backward, forward annotation, data loading, plain op), our name for a communication op,
its payload bytes, and the painting of a rank's thread into forward/backward/optimizer spans.

Painting: every classified interval of the main thread is laid on the timeline and each instant takes
the highest-priority class covering it (comm > data > optimizer > backward > forward annotation >
plain op, which counts as forward). Runs of one class separated by less than `merge_gap_ns` of
unclassified time join into one span, so a forward pass is one span like the tracer's, not 500 ops.
"""

from __future__ import annotations

import re
from bisect import bisect_right

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


def paint(intervals: list[tuple[int, int, int]], merge_gap_ns: int) -> list[tuple[int, int, int]]:
    """(start, end, class) intervals -> non-overlapping spans (start, end, class), highest class wins,
    same-class runs joined across gaps shorter than merge_gap_ns. COMM spans are left out (comm ops
    are events of their own)."""
    if not intervals:
        return []
    points = []
    for start, end, cls in intervals:
        if end > start:
            points.append((start, 1, cls))
            points.append((end, -1, cls))
    points.sort(key=lambda p: (p[0], p[1]))
    counts = [0] * 6
    segments: list[list[int]] = []
    current, since = -1, 0
    for t, delta, cls in points:
        top_before = current
        counts[cls] += delta
        current = max((c for c in range(6) if counts[c] > 0), default=-1)
        if current != top_before:
            if top_before >= 0 and t > since:
                _append(segments, since, t, top_before, merge_gap_ns)
            since = t
    return [(s[0], s[1], s[2]) for s in segments if s[2] != COMM]


def _append(segments: list[list[int]], start: int, end: int, cls: int, merge_gap_ns: int) -> None:
    same = cls if cls != OP else FWD  # plain ops are forward work: they join forward annotations
    if segments:
        last = segments[-1]
        if last[2] == same and start - last[1] <= merge_gap_ns:
            last[1] = end
            return
    segments.append([start, end, same])


class StepIndex:
    """Which ProfilerStep#N an instant falls in (None outside every step)."""

    def __init__(self, steps: list[tuple[int, int, int]]) -> None:
        self.steps = sorted(steps, key=lambda s: s[1])  # (number, start, end)
        self.starts = [s[1] for s in self.steps]

    def split(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(step, start, end) pieces of [start, end) cut at step boundaries (a span painted across the
        end of one step and the start of the next is two spans, as the tracer would have recorded)."""
        i = max(0, bisect_right(self.starts, start) - 1)
        out = []
        while i < len(self.steps) and self.steps[i][1] < end:
            number, s, e = self.steps[i]
            lo, hi = max(start, s), min(end, e)
            if hi > lo:
                out.append((number, lo, hi))
            i += 1
        return out

    def at(self, t: int) -> int | None:
        i = bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.steps[i][2]:
            return self.steps[i][0]
        return None
