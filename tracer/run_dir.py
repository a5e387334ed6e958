"""Paths and the manifest (run.json) of a run directory; see docs/run-directory.md.

    RUN/run.json, RUN/<table>/rank=NNNNN/seg-*.parquet, RUN/inflight/, RUN/checkpoints/

RUN may be an object-store URL (s3://bucket/prefix): the manifest functions and run_entries go through
tracer/storage.py, which also maps the trainer's scratch folder to its URL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megascope.tracer.schema import SCHEMA_VERSION, TABLES, SchemaVersionError
from megascope.tracer.storage import is_url, locate

MANIFEST = "run.json"


def table_dir(run_dir: str | Path, table: str, rank: int) -> Path:
    if table not in TABLES:
        raise KeyError(f"unknown table '{table}'")
    return Path(run_dir) / table / f"rank={rank:05d}"


def inflight_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "inflight"


INCIDENTS_FILE = "incidents.jsonl"
"""The supervisor's incidents (dead, silent, stalled ranks, restarts), one JSON object a line."""
SELF_CHECK_DIR = "self_check"
"""The self-checks run before a restart, attempt-NN.json each."""
FINDINGS_FILE = "findings.jsonl"
"""What `megascope watch` announced (start, end and final records; docs/watch.md, Records)."""

RUN_ENTRIES = (MANIFEST, *TABLES, "inflight", "checkpoints", "heartbeats", "health.json", INCIDENTS_FILE,
               SELF_CHECK_DIR)
"""What a run writes at the top of its directory (tracer, checkpoints, supervisor)."""


def run_entries(run_dir: str | Path) -> list[str]:
    """The run entries `run_dir` already holds: empty for a missing or empty directory, or for one
    with only other files. Writing a new run where this is not empty would mix two runs' data.
    On an object store: the entries present under the prefix (raises storage.StorageError)."""
    location = locate(run_dir)
    if location.remote:
        return [name for name in RUN_ENTRIES if location.exists(name)]
    path = Path(run_dir)
    return [name for name in RUN_ENTRIES if (path / name).exists()] if path.is_dir() else []


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON under a temporary name, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _write_manifest_at(run_dir: str | Path, manifest: dict[str, Any]) -> None:
    location = locate(run_dir)
    if not location.remote:
        write_json_atomic(Path(run_dir) / MANIFEST, manifest)
        return
    location.write_bytes(MANIFEST, json.dumps(manifest, indent=2, default=str).encode())  # one PUT: atomic
    if not is_url(run_dir):  # the trainer's scratch folder standing for a URL keeps a copy: the trainer
        write_json_atomic(Path(run_dir) / MANIFEST, manifest)  # (restarts, --resume) looks for run.json there


def write_manifest(run_dir: str | Path, manifest: dict[str, Any]) -> None:
    manifest = {"schema_version": SCHEMA_VERSION, **manifest}
    _write_manifest_at(run_dir, manifest)


def update_manifest(run_dir: str | Path, **fields: Any) -> None:
    """Merge fields into run.json (rank 0 only: one writer, no lock needed)."""
    manifest = read_manifest(run_dir, check_version=False)
    manifest.update(fields)
    _write_manifest_at(run_dir, manifest)


def read_manifest(run_dir: str | Path, check_version: bool = True) -> dict[str, Any]:
    location = locate(run_dir)
    path: Any = location.display + "/" + MANIFEST if location.remote else Path(run_dir) / MANIFEST
    missing = FileNotFoundError(
        f"{location.display if location.remote else run_dir} is not a megascope run directory (no {MANIFEST}); "
        "pass the directory given to `megascope train --run-dir` or made by `megascope import`")
    if location.remote:
        try:
            text = location.read_bytes(MANIFEST).decode("utf-8", errors="replace")
        except FileNotFoundError:
            location.check_reachable()  # a missing bucket or endpoint says so, not "no run.json"
            raise missing from None
    elif not path.is_file():
        raise missing
    else:
        text = path.read_text()
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); the run directory is damaged") from None
    version = manifest.get("schema_version")
    if check_version and version != SCHEMA_VERSION:
        hint = "upgrade megascope" if isinstance(version, int) and version > SCHEMA_VERSION else \
            "re-import or re-run it with this version"
        raise SchemaVersionError(
            f"{run_dir} was written with trace schema v{version}; this megascope reads v{SCHEMA_VERSION}: {hint}")
    return manifest
