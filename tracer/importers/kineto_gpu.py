"""GPU activity of a Kineto trace (`cat` kernel, gpu_memcpy, gpu_memset on a device's streams) into the
kernels table, each with the host time of the runtime call that launched it (`cudaLaunchKernel`,
`cudaMemcpyAsync`, `cuLaunchKernel`, `cudaGraphLaunch`, ... with the same `args.correlation`: the CUPTI
correlation id, the same id the tracer's CUPTI recorder writes).

The launch and its kernel can be anywhere in the file relative to each other (Kineto writes CPU ops and
GPU activity in buffer order), and a long GPU trace holds millions of each: both are spooled while the
file streams (the `act` and `launch` tables of the file's spool.Spool) and joined on the correlation id
by DuckDB (`write_kernels`), which spills to disk, so memory stays bounded.

Rows: the kernels schema (rank, name, stream, correlation, start_ns, end_ns; tracer/schema.py) plus
`launch_ns` (-1: the launch is not in the trace), `step` (the ProfilerStep#N holding the launch, else
the kernel's start; -1 outside every step), `kind` (kernel | memcpy | memset), `device`, `bytes`
(memcpy/memset payload, 0 otherwise), and for NCCL/RCCL kernels `comm_op` (all_reduce, send_recv, ...)
and `comm_kind` (collective | p2p | comm), '' for every other row (comm_kernels.py: the name table).
The analyzer's `kernels` view shows the schema columns; the
extras are in the segments (`read_parquet('RUN/kernels/rank=*/*.parquet')`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from megascope.tracer.importers import spool as sp
from megascope.tracer.importers.comm_kernels import comm_kernel
from megascope.tracer.importers.kineto_ops import StepIndex
from megascope.tracer.importers.spool import Spool

GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_LAUNCH_WORDS = ("Launch", "Memcpy", "Memset", "memcpy", "memset")

ACTIVITY = pa.schema([("name", pa.string()), ("kind", pa.string()), ("stream", pa.int64()),
                      ("device", pa.int32()), ("correlation", pa.int64()), ("start", pa.int64()),
                      ("end", pa.int64()), ("bytes", pa.int64())])
LAUNCH = pa.schema([("correlation", pa.int64()), ("launch", pa.int64())])
KERNEL_ROWS = pa.schema([("rank", pa.int32()), ("name", pa.string()), ("stream", pa.int64()),
                         ("correlation", pa.int64()), ("start_ns", pa.int64()), ("end_ns", pa.int64()),
                         ("launch_ns", pa.int64()), ("step", pa.int64()), ("kind", pa.string()),
                         ("device", pa.int32()), ("bytes", pa.int64()), ("comm_op", pa.string()),
                         ("comm_kind", pa.string())])


def is_launch(name: str) -> bool:
    """A runtime/driver call that puts work on a stream (not a sync, an event record, a malloc)."""
    return any(w in name for w in _LAUNCH_WORDS)


def _int(value: Any, default: int = -1) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def add_activity(spool: Spool, name: str, cat: str, args: dict, start: int, end: int) -> None:
    """One GPU activity (a kernel, memcpy or memset) into the spool's `act` table."""
    spool.append("act", (name, GPU_CATS[cat], _int(args.get("stream")), _int(args.get("device")),
                         _int(args.get("correlation")), start, end, max(0, _int(args.get("bytes"), 0))))


def add_launch(spool: Spool, correlation: Any, start: int) -> None:
    """One runtime/driver launch into the spool's `launch` table (skipped without a correlation id)."""
    corr = _int(correlation)
    if corr >= 0:
        spool.append("launch", (corr, start))


def write_kernels(con: Any, folder: str, rank: int, base_ns: int, steps: StepIndex, writer,
                  batch_rows: int = 262_144) -> tuple[int, int, int]:
    """Join the spooled activity with its launches (on the spool's DuckDB connection `con`), map to the
    run's clock, write the kernels segments. Returns (rows written, rows without a launch, comm kernels)."""
    acts, launched = sp.parts(folder, "act"), sp.parts(folder, "launch")
    if acts is None:
        return 0, 0, 0
    launches = ("(SELECT correlation, min(launch) AS launch FROM read_parquet($launch) GROUP BY correlation)"
                if launched else "(SELECT NULL::BIGINT AS correlation, NULL::BIGINT AS launch WHERE false)")
    reader = con.sql(
        "SELECT a.name, a.kind, a.stream, a.device, a.correlation, a.start, a.\"end\", a.bytes, "
        f"coalesce(l.launch, -1) AS launch FROM read_parquet($acts) a LEFT JOIN {launches} l "
        "ON a.correlation = l.correlation AND a.correlation >= 0",
        params={"acts": acts, **({"launch": launched} if launched else {})}).to_arrow_reader(batch_rows)
    numbers, starts, ends = steps.arrays()
    written = unlaunched = comm = 0
    for batch in reader:
        cols = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in batch.schema.names}
        launch = cols["launch"].astype(np.int64)
        found = launch >= 0
        at = np.where(found, launch, cols["start"].astype(np.int64))
        step = _step_of(at, numbers, starts, ends)
        n = len(launch)
        ops, kinds = _comm_columns(batch.column("name").to_pylist(), cols["kind"])
        comm += sum(1 for k in kinds if k)
        table = pa.Table.from_arrays([
            pa.array(np.full(n, rank, dtype=np.int32)), batch.column("name"),
            pa.array(cols["stream"].astype(np.int64)), pa.array(cols["correlation"].astype(np.int64)),
            pa.array(cols["start"].astype(np.int64) + base_ns), pa.array(cols["end"].astype(np.int64) + base_ns),
            pa.array(np.where(found, launch + base_ns, -1)), pa.array(step), batch.column("kind"),
            pa.array(cols["device"].astype(np.int32)), pa.array(cols["bytes"].astype(np.int64)),
            pa.array(ops, pa.string()), pa.array(kinds, pa.string()),
        ], schema=KERNEL_ROWS)
        writer.kernels(rank, table)
        written += n
        unlaunched += int(n - found.sum())
    return written, unlaunched, comm


def _comm_columns(names: list[str], kinds: np.ndarray) -> tuple[list[str], list[str]]:
    """comm_op and comm_kind of each row ('' for compute kernels, memcpy and memset)."""
    ops, comm_kinds = [], []
    for name, kind in zip(names, kinds):
        found = comm_kernel(name) if kind == "kernel" else None
        ops.append(found[0] if found else "")
        comm_kinds.append(found[1] if found else "")
    return ops, comm_kinds


def _step_of(t: np.ndarray, numbers: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The ProfilerStep number holding each instant, -1 outside every step."""
    if not len(starts):
        return np.full(len(t), -1, dtype=np.int64)
    i = np.searchsorted(starts, t, side="right") - 1
    ok = (i >= 0) & (t < ends[np.maximum(i, 0)])
    return np.where(ok, numbers[np.maximum(i, 0)], -1).astype(np.int64)
