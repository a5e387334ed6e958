"""The trace schema: the columns of every table in a run directory, versioned.

Writers (tracer, importers, simulator) and the reader (analyzer) both import these definitions;
docs/schema.md describes each column. Bump SCHEMA_VERSION on any incompatible change.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
"""Version of the run-directory layout and table schemas below; stored in run.json."""

KINDS = ("compute", "collective", "p2p", "host")
WAIT_SUFFIX = ".wait"
"""Name suffix of the host span covering a blocking wait() on an async op (`<op>.wait`)."""
"""Values of events.kind."""

EVENTS = pa.schema([
    ("rank", pa.int32()),        # global rank that recorded the span
    ("step", pa.int64()),        # training step
    ("microbatch", pa.int32()),  # micro-batch index, -1 where it does not apply
    ("chunk", pa.int16()),       # virtual pipeline chunk, -1 where it does not apply
    ("name", pa.string()),       # forward, backward, reduce_scatter, send, recv, optimizer, ...
    ("kind", pa.string()),       # compute | collective | p2p | host
    ("group", pa.string()),      # dp | tp | pp | world | "" (no group)
    ("seq", pa.int64()),         # n-th operation of this rank in this group (matches across members), -1
    ("peer", pa.int32()),        # p2p partner global rank, -1
    ("bytes", pa.int64()),       # payload bytes, 0 where none
    ("issue_ns", pa.int64()),    # host time the op was issued (aligned clock, Unix epoch ns)
    ("start_ns", pa.int64()),    # when it started running (aligned clock, Unix epoch ns)
    ("end_ns", pa.int64()),      # when it finished (aligned clock, Unix epoch ns)
])

STEPS = pa.schema([
    ("rank", pa.int32()),
    ("step", pa.int64()),
    ("start_ns", pa.int64()),
    ("end_ns", pa.int64()),
    ("tokens", pa.int64()),        # tokens this rank's data-parallel replica processed in the step
    ("loss", pa.float64()),        # NaN where the rank computes no loss (not the last stage)
    ("lr", pa.float64()),
    ("grad_norm", pa.float64()),
    ("model_flops", pa.float64()),  # model FLOPs of the whole job in this step (Megatron formula)
    ("dropped_events", pa.int64()),  # events dropped so far by this rank's tracer (bounded memory)
])

GPU = pa.schema([
    ("rank", pa.int32()),
    ("ts_ns", pa.int64()),
    ("gpu_util", pa.float32()),     # %
    ("mem_util", pa.float32()),     # %
    ("mem_used_bytes", pa.int64()),
    ("power_w", pa.float32()),
    ("temp_c", pa.float32()),
    ("sm_clock_mhz", pa.float32()),
    ("throttle_reasons", pa.int64()),  # NVML clocks-event reason bit mask
    ("ecc_errors", pa.int64()),        # volatile uncorrected ECC errors
    ("pcie_tx_kbs", pa.float32()),
    ("pcie_rx_kbs", pa.float32()),
    ("nvlink_tx_kbs", pa.float32()),
    ("nvlink_rx_kbs", pa.float32()),
])

KERNELS = pa.schema([
    ("rank", pa.int32()),
    ("name", pa.string()),
    ("stream", pa.int64()),
    ("correlation", pa.int64()),
    ("start_ns", pa.int64()),
    ("end_ns", pa.int64()),
])

HOST_STEPS = pa.schema([
    ("rank", pa.int32()),
    ("step", pa.int64()),               # the step whose record_step closed the window
    ("start_ns", pa.int64()),           # the window: the previous record_step (aligned clock, Unix epoch ns)
    ("end_ns", pa.int64()),             # ... to this one
    ("cpu_ns", pa.int64()),             # the training thread's CPU time in the window (schedstat), -1 absent
    ("run_delay_ns", pa.int64()),       # the training thread runnable but waiting for a CPU (schedstat), -1 absent
    ("throttled_ns", pa.int64()),       # the process's cgroup throttled by its CPU quota (cpu.stat), -1 absent
    ("gc_ns", pa.int64()),              # Python garbage collection pauses (gc.callbacks)
    ("gc_count", pa.int64()),           # collections in the window
])
"""Where a rank's host time went, one row per step after its first (tracer/host_sampler.py): the
evidence the analyzer's cause step (analyzer/detect/cause.py) reads."""

# Summaries at the edge (tracer/edge_summary.py): what the analyzer's event pass derives from a rank's
# events, written by the rank's own tracer (tracer/sql/ holds the macros both run); docs/schema.md.
EDGE_RANK_STEP = pa.schema(
    [("rank", pa.int32()), ("step", pa.int64()), ("start_ns", pa.int64()), ("end_ns", pa.int64()),
     ("step_time_s", pa.float64()), ("tokens", pa.int64()), ("model_flops", pa.float64())]
    + [(f"{c}_s", pa.float64()) for c in ("compute", "forward", "backward", "optimizer", "recv", "collective",
                                          "nested_wait", "data_wait", "gap", "gap_p2p", "gap_coll", "own", "other")]
    + [("n_events", pa.int64()), ("final", pa.bool_())])
"""One row per summarized step: rank_step.sql's columns less the topology's (pp, dp, tp, host), and
`final`: written by the rank's last summary, at close, when every steps row it wrote was summarized
(the analyzer's coverage check: a rank without such a row is read from its events)."""
EDGE_PEER_STEP = pa.schema(
    [("rank", pa.int32()), ("step", pa.int64()), ("peer", pa.int32())]
    + [(c, pa.int64()) for c in ("compute_ns", "forward_ns", "backward_ns", "optimizer_ns", "nested_ns", "recv_ns",
                                 "collective_ns", "data_wait_ns", "gap_ns", "gap_p2p_ns", "gap_coll_ns",
                                 "send_min_ns", "sends", "recv_min_ns", "n_events")])
"""Per step and p2p peer (-1: no peer), ns: event_pass.sql's per (rank, step, peer) rows."""
EDGE_COLLECTIVES = pa.schema([
    ("rank", pa.int32()), ("step", pa.int64()), ("group", pa.string()), ("seq", pa.int64()),
    ("op_name", pa.string()), ("start_ns", pa.int64()), ("end_ns", pa.int64()),
])
"""The rank's collective ops (its arrival at each, and the end): late arrivals' inputs."""

TRACED: dict[str, pa.Schema] = {"events": EVENTS, "steps": STEPS, "gpu": GPU, "kernels": KERNELS,
                                 "host_steps": HOST_STEPS}
"""The tables a tracer records (one buffer each)."""
EDGE: dict[str, pa.Schema] = {"edge_rank_step": EDGE_RANK_STEP, "edge_peer_step": EDGE_PEER_STEP,
                              "edge_collectives": EDGE_COLLECTIVES}
"""The summary tables a tracer derives from what it recorded (tracer/edge_summary.py)."""
TABLES: dict[str, pa.Schema] = {**TRACED, **EDGE}
"""Table name -> schema; each table lives in RUN/<table>/rank=NNNNN/*.parquet."""


class SchemaVersionError(RuntimeError):
    """A run directory written with a schema this version of megascope cannot read."""
