"""The event pass on a Ray cluster (`megascope analyze RUN --engine ray [--address HOST:PORT]`).

The raw-event work - the batch function of event_pass.py over one batch of ranks: read its events and
steps segments once, the per (rank, step, peer) rows, the batch's rank_step rows and its collective
partials - runs as one Ray task per batch; on a run whose ranks summarized their steps at the edge, the
task reads the batch's summaries instead (scan_edge_batch: its rank_step and p2p rows, and the partials
of its collective rows). A task ships paths, not data: the run directory, the
batch's rank-folder patterns and the pass plan (a few hundred bytes); the task opens the run directory
itself (its own Store and DuckDB), and returns the batch's three tables as Arrow (O(ranks x steps)
rows: the raw events never leave the worker). The driver appends them in batch order with the same
loop as the local engine, then merges centrally what needs every batch: the collective instances
from their partials (a group instance spans batches), the late arrivals, the incomplete-data rules
and the detectors. The tables are the local engine's (tests/test_engine_ray.py).

A run on object storage (`analyze s3://bucket/run --engine ray`) needs no shared filesystem: the task
gets the URL and mirrors only its batch's events and steps segments (and run.json) into its worker's
own cache ($MEGASCOPE_CACHE_DIR on that host, remote_run.sync with a RankFilter), while the driver keeps
a partial mirror of the few ranks it reads itself (remote_run.PartialMirror). The workers read the
bucket through the AWS chain of their own environment; the driver's AWS_* variables are set on every
task (Ray's runtime_env), so a cluster started without them still reaches the bucket. A local run
directory must be reachable by every worker under the same path. Workers need megascope installed
(`pip install 'megascope[ray]'`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megascope.analyzer.data.event_pass import (
    BATCH_TABLES,
    EDGE_TASK_TABLES,
    PassPlan,
    define_sql,
    scan_batch,
    scan_edge_batch,
)
from megascope.analyzer.data.store import Store
from megascope.tracer.storage import is_url

TASK_TABLES = ("events", "steps")
"""What a task reads of its batch's rank folders (scan_batch), so all it mirrors of a URL run; a pass
over the summaries at the edge reads EDGE_TASK_TABLES instead (scan_edge_batch)."""


class EngineError(RuntimeError):
    """Ray is missing or the cluster cannot be reached; the message says what to do."""


def _ray(local: bool = False):
    """Import ray; settings it reads at import time are made first."""
    if local and "ray" not in sys.modules:
        # a Ray started here serves this process only: single-machine mode binds every Ray process to
        # 127.0.0.1 instead of the host's address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not local and "ray" not in sys.modules and "RAY_AUTH_MODE" not in os.environ \
            and (Path.home() / ".ray" / "auth_token").is_file():
        # as `ray start` does: a token in Ray's default place means the cluster checks it
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        import ray
    except ImportError:
        raise EngineError("--engine ray needs Ray: pip install 'megascope[ray]' (or pip install ray)") from None
    return ray


def scan_batch_arrow(run_dir: str, prefixes: list[str] | None, plan: PassPlan, threads: int = 1) -> dict[str, Any]:
    """The batch function as a task runs it (the plan says which: events or summaries at the edge):
    open the run, scan one batch, return its tables as Arrow
    (`tables`: BATCH_TABLES -> pyarrow.Table) and the damaged segments the batch found (`damaged`:
    (table, path relative to the run, error), for Store.adopt_damaged once made the driver's path).
    A URL `run_dir` (object storage) is first mirrored into this worker's own cache, the batch's events
    and steps segments only (remote_run.sync with a RankFilter), plus run.json and the small files."""
    if is_url(run_dir):
        from megascope.analyzer.data.remote_run import HeldStore, RankFilter, mirror_folder, sync
        folder = mirror_folder(run_dir)
        held = RankFilter(prefixes or ["rank=*"], EDGE_TASK_TABLES if plan.edge else TASK_TABLES)
        sync(run_dir, folder, ranks=held)
        # the other tasks of this host fetch their batches into the same folder meanwhile
        store: Store = HeldStore(folder, held, threads=threads)
    else:
        store = Store(run_dir, threads=threads)
    define_sql(store)
    scan = scan_edge_batch if plan.edge else scan_batch
    store.run_with_retry(lambda: scan(store, prefixes, plan))
    tables = {name: store.con.sql(f"SELECT * FROM {name}").to_arrow_table() for name in BATCH_TABLES}
    damaged = []
    for table, path in store.damaged:
        prefix = f"skipped damaged segment {os.path.relpath(path, store.path)}: "
        error = next((w[len(prefix):] for w in store.warnings if w.startswith(prefix)), "damaged")
        damaged.append((table, os.path.relpath(path, store.path), error))
    store.con.close()
    return {"tables": tables, "damaged": damaged}


def forwarded_env() -> dict[str, str]:
    """The driver's AWS_* variables (credentials, region, endpoint), set on every task: a worker
    reads the bucket through the standard AWS chain of its own environment, which the cluster's
    `ray start` may not have."""
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


class RayEngine:
    """Maps the event pass's batch function over Ray tasks (one per batch of ranks, `cpus_per_task`
    CPUs and DuckDB threads each), on the cluster at `address` (None: start a local one)."""

    def __init__(self, address: str | None = None, cpus_per_task: int = 1) -> None:
        ray = _ray(local=not address)
        self.cpus_per_task = cpus_per_task
        if not ray.is_initialized():
            try:
                if address:
                    ray.init(address=address, log_to_driver=False)
                else:
                    ray.init(include_dashboard=False, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise EngineError(f"cannot connect to the Ray cluster at {address or 'a new local one'}: "
                                  f"{str(exc).splitlines()[0][:200]}; start one with `ray start --head` "
                                  "and pass its address") from None
        self._task = ray.remote(scan_batch_arrow)

    def map_batches(self, store: Store, batches: list[list[str] | None], plan: PassPlan) -> Iterator[int]:
        ray = _ray()
        # a run on object storage (remote_run.PartialMirror): the URL, each task mirrors its own batch
        run_dir = getattr(store, "url", None) or str(store.path.resolve())
        env = forwarded_env()
        task = self._task.options(num_cpus=self.cpus_per_task, **({"runtime_env": {"env_vars": env}} if env else {}))
        refs = [task.remote(run_dir, prefixes, plan, self.cpus_per_task) for prefixes in batches]
        for i in range(len(refs)):
            result = ray.get(refs[i])
            # the batch's tables leave the object store once appended: holding every ref kept all of
            # them (the driver peaked at 8.4 GB on 12,288 ranks x 1,000 steps of summaries)
            refs[i] = None
            store.adopt_damaged([(table, str(store.path / rel), error) for table, rel, error in result["damaged"]])
            for name, table in result["tables"].items():
                store.con.register(name, table)
            try:
                yield i
            finally:
                for name in BATCH_TABLES:
                    store.con.unregister(name)
                result = None
