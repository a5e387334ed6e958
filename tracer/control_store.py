"""The job's control plane on its c10d store: heartbeats and in-flight (hang) records as small JSON
records in a TCPStore, so that no host has to read files another host wrote.

    megascope/control/<kind>/<rank>     the latest record of that rank (JSON)
    megascope/control/<kind>/ranks      "3,0,1,..." every rank that wrote one (appended once per rank)
    megascope/control/<kind>/version    bumped on every write: a reader polls one integer, not N records

Which store: `MEGASCOPE_CONTROL_STORE=HOST:PORT` (set by `megascope train` for its ranks: the driver of
node 0 hosts a TCPStore that outlives every worker restart), else the store of the default process
group (torchrun's, for a job traced with `megascope attach`), else none: then the callers fall back to
files in the run directory (single host, or a shared filesystem). Each user opens its own client with a
short timeout. A failed store operation is logged (the first, then every 100th), counted in `failures`
and answered with None/False: monitoring never stops training. The tracer layer owns this module so that
the hang watchdog (tracer) and the heartbeats and supervisor (trainer) share it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import timedelta
from typing import Any

log = logging.getLogger("megascope.control")

ENV = "MEGASCOPE_CONTROL_STORE"
PREFIX = "megascope/control/"
OP_TIMEOUT_S = 5.0
"""A store operation that takes longer failed (the store's host is gone or frozen): beats go on."""


def parse_address(spec: str) -> tuple[str, int]:
    """'HOST:PORT' (IPv6 as [::1]:PORT) -> (host, port); ValueError with what to write otherwise."""
    host, sep, port = spec.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"control store address '{spec}' is not HOST:PORT (e.g. 10.0.0.1:29501)")
    return host.strip("[]"), int(port)


class ControlStore:
    """One client connection to the job's store. Thread-safe (one lock); reconnects after a failure."""

    def __init__(self, host: str, port: int, timeout_s: float = OP_TIMEOUT_S) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.failures = 0
        """Store operations that failed (timeouts, a lost connection); each was survived."""
        self.last_error: str | None = None
        self._client: Any = None
        self._indexed: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_store(cls, store: Any, timeout_s: float = OP_TIMEOUT_S) -> "ControlStore | None":
        """A new client of the TCPStore under `store` (PrefixStores unwrapped); None if it is no TCPStore."""
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if not host or not port:
            return None
        return cls(str(host), int(port), timeout_s)

    # ------------------------------------------------------------------ records

    def put(self, kind: str, rank: int, record: dict[str, Any]) -> bool:
        """Publish `record` as `rank`'s latest of `kind`. False (counted, logged) if the store failed."""
        data = json.dumps(record, default=str)
        with self._lock:
            try:
                client = self._connect()
                client.set(f"{PREFIX}{kind}/{rank}", data)
                if (kind, rank) not in self._indexed:
                    client.append(f"{PREFIX}{kind}/ranks", f"{rank},")
                    self._indexed.add((kind, rank))
                client.add(f"{PREFIX}{kind}/version", 1)
                return True
            except Exception as exc:  # noqa: BLE001 - any store failure is survived
                self._failed(f"put {kind}/{rank}", exc)
                return False

    def get_all(self, kind: str) -> dict[int, dict[str, Any]] | None:
        """Every rank's latest record of `kind` (one round trip for the index, one for the records);
        None if the store failed. Records that do not parse are skipped."""
        with self._lock:
            try:
                client = self._connect()
                index = f"{PREFIX}{kind}/ranks"
                if not client.check([index]):
                    return {}
                ranks = sorted({int(r) for r in client.get(index).decode().split(",") if r.strip()})
                values = client.multi_get([f"{PREFIX}{kind}/{r}" for r in ranks]) if ranks else []
            except Exception as exc:  # noqa: BLE001
                self._failed(f"read {kind}", exc)
                return None
        out: dict[int, dict[str, Any]] = {}
        for rank, raw in zip(ranks, values):
            try:
                out[rank] = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                continue
        return out

    def version(self, kind: str) -> int | None:
        """How many records of `kind` were written so far (None if the store failed)."""
        with self._lock:
            try:
                return int(self._connect().add(f"{PREFIX}{kind}/version", 0))
            except Exception as exc:  # noqa: BLE001
                self._failed(f"version {kind}", exc)
                return None

    def close(self) -> None:
        with self._lock:
            self._client = None

    # ------------------------------------------------------------------ connection

    def _connect(self) -> Any:
        if self._client is None:
            import torch.distributed as dist

            self._client = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                         timeout=timedelta(seconds=self.timeout_s))
        return self._client

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{what}: {exc!r}"
        self._client = None  # reconnect next time: the connection may be broken
        self._indexed.clear()  # a restarted store lost the index; appending twice is harmless
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning("control store %s: %s failed (%d failure(s) so far; monitoring goes on): %r",
                        self.address, what, self.failures, exc)


def from_env(timeout_s: float = OP_TIMEOUT_S) -> ControlStore | None:
    """The store named by $MEGASCOPE_CONTROL_STORE; None when unset (a bad value is logged, not raised)."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return None
    try:
        host, port = parse_address(spec)
    except ValueError as exc:
        log.warning("%s: %s; heartbeats and hang records go to files", ENV, exc)
        return None
    return ControlStore(host, port, timeout_s)


def connect(timeout_s: float = OP_TIMEOUT_S) -> ControlStore | None:
    """The job's control store: $MEGASCOPE_CONTROL_STORE, else the default process group's TCPStore,
    else None (no store: the caller writes files)."""
    env = from_env(timeout_s)
    if env is not None:
        return env
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return ControlStore.from_store(dist.distributed_c10d._get_default_store(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - no usable store: files
        log.warning("control store: the process group's store is not usable (%r); using files", exc)
    return None
