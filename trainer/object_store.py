"""`megascope train --run-dir s3://bucket/prefix`: the trace (segments, run.json) goes to the object store;
the trainer's own files go to a local scratch folder.

The ranks' tracers PUT their segments straight to the store (tracer/storage.py). What still needs a
filesystem (checkpoints, heartbeat/in-flight files when no control store is used, the supervisor's
health.json and incidents.jsonl, self-check records) is written under one local folder per URL:
$MEGASCOPE_CACHE_DIR (default ~/.cache/megascope)/scratch/<scheme>/<bucket>/<prefix>. The job runs with
cfg.run_dir = that folder and MEGASCOPE_RUN_URL/MEGASCOPE_RUN_SCRATCH in the environment, which make the
tracer's sink and the manifest functions write to the URL instead. At the end the driver uploads what the
analyzer reads from those files (incidents, health, in-flight records, self-checks).
"""

from __future__ import annotations

import os
import shutil
import sys

from megascope.tracer.run_dir import INCIDENTS_FILE, MANIFEST, SELF_CHECK_DIR, run_entries
from megascope.tracer.storage import StorageError, is_url, local_folder_for, locate, redirect_env, upload_tree
from megascope.trainer.config import JobConfig

UPLOADED_AT_END = ("health.json", INCIDENTS_FILE, "inflight", SELF_CHECK_DIR)
"""Scratch entries copied to the store when the job ends (the analyzer and dashboard read them)."""


def use_url_run_dir(cfg: JobConfig, resume: bool, joining: bool = False) -> tuple[str | None, str | None]:
    """When cfg.run_dir is a URL: check the store, point cfg.run_dir at the scratch folder and set the
    redirect for this process and the ranks it starts. Returns (the URL or None, a problem or None).
    `joining`: a node other than node 0 of a multi-node job, which finds the job's data there (node 0
    checked the URL for the job; preflight.check_run_dir)."""
    url = cfg.run_dir
    if not is_url(url):
        return None, None
    scratch = local_folder_for(url, "scratch")
    try:
        locate(url).check_reachable()
        held = [] if joining else run_entries(url)
    except StorageError as exc:
        return url, str(exc)
    if held and not resume:
        return url, (f"{url} already holds a run ({', '.join(held)}); a new run there would mix both runs' data: "
                     "pass a new --run-dir, or --resume to continue it on the machine that holds its checkpoints")
    if held and not (scratch / MANIFEST).is_file():
        return url, (f"--resume: the checkpoints of an object-store run are in its local scratch folder {scratch}, "
                     "which this machine does not have; pass a new --run-dir")
    if not held and not joining and scratch.exists():  # a former run's leftovers: its URL holds no run any more
        shutil.rmtree(scratch, ignore_errors=True)
    cfg.run_dir = str(scratch)
    os.environ.update(redirect_env(url, scratch))
    print(f"[megascope] trace -> {url}; local scratch (checkpoints, heartbeats, health, incidents) -> {scratch}",
          flush=True)
    return url, None


def upload_leftovers(scratch: str, url: str) -> None:
    """Copy the scratch files the analyzer reads to the store; a failure is one line, never an exit code."""
    try:
        upload_tree(scratch, locate(url), entries=UPLOADED_AT_END)
    except OSError as exc:
        print(f"megascope train: could not upload {', '.join(UPLOADED_AT_END)} from {scratch} to {url}: {exc}",
              file=sys.stderr)
