"""Two-stage checkpoints (MegaScale 4.4): snapshot to host memory, persist in the background.

This is robust.checkpoint_format = "snapshot"; the default, "dcp" (trainer/robust/checkpoint_dcp.py: the same
host snapshot, written by torch.distributed.checkpoint, reshardable across dp, to a path or an fsspec
URL), shares this module's listing, manifest, pruning and layout checks (`list_complete_at`,
`publish_manifest`, `check_resumable`); checkpoint_format.py picks the manager.

Stage 1 (training thread, the only stall): every tensor of this rank's training state is copied into
reusable host buffers (pinned on GPU, copies enqueued on the current stream; no device sync here).
Stage 2 (writer thread): waits for the copies, writes the shard under a temporary name, fsyncs and
renames it; rank 0 then waits until every expected shard is in place and writes the manifest last.
A checkpoint counts only once its manifest exists and lists files that all exist, so a crash during
a save leaves the previous checkpoint as the latest complete one. The last `keep_last` are kept.

    RUN/checkpoints/step-000040/shard-pp000-tp000-dp001.pt   one per (pp, tp, dp) writer
    RUN/checkpoints/step-000040/manifest.json                step, layout, files, sizes, timings

Who writes: with the ZeRO optimizer every dp rank holds a different shard, so every rank writes; with
plain data parallelism (or dp=1) the dp replicas are identical and only dp rank 0 writes.
Restore: dp rank 0 of each (pp, tp) reads the shard files of its group and broadcasts them to its dp
peers (comm.broadcast), so storage reads do not grow with dp. A different layout is refused.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megascope import tracer as tracing
from megascope.tracer import comm
from megascope.tracer.run_dir import write_json_atomic
from megascope.trainer.config import JobConfig
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.robust import checkpoint_io as cio
from megascope.trainer.robust.checkpoint_io import broadcast_tree, host_snapshot, save_file

FORMAT = 1
MANIFEST = "manifest.json"
STEP_DIR_RE = re.compile(r"^step-(\d{6,})$")
PUBLISH_TIMEOUT_S = 600.0
"""How long rank 0 waits for the other ranks' shards before giving up on a checkpoint."""


RESHARDABLE = ("dp", "zero")
"""Layout fields a DCP checkpoint (checkpoint_dcp.py) may change between save and resume."""


class CheckpointLayoutError(ValueError):
    """The checkpoint was saved with another layout or model; the message says what to do."""


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    manifest: dict[str, Any]


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step-{step:06d}"


def shard_name(pp: int, tp: int, dp: int) -> str:
    return f"shard-pp{pp:03d}-tp{tp:03d}-dp{dp:03d}.pt"


def layout_of(cfg: JobConfig) -> dict[str, Any]:
    """What must match between a checkpoint and the job resuming from it."""
    p = cfg.parallel
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "zero": p.zero, "bucket_mb": p.bucket_mb,
            "optimizer": cfg.train.optimizer, "model": dict(vars(cfg.model))}


def writer_dp_ranks(layout: dict[str, Any]) -> list[int]:
    """dp ranks whose state differs (and so is written): all with ZeRO, else only replica 0."""
    return list(range(layout["dp"])) if layout["zero"] and layout["dp"] > 1 else [0]


def expected_files(layout: dict[str, Any]) -> list[str]:
    return [shard_name(pp, tp, dp) for pp in range(layout["pp"]) for tp in range(layout["tp"])
            for dp in writer_dp_ranks(layout)]


def checkpoint_home(cfg: JobConfig) -> str:
    """Where the job's checkpoints go: robust.checkpoint_dir (a path or an fsspec URL), else RUN/checkpoints."""
    given = getattr(cfg.robust, "checkpoint_dir", "")
    return given or str(checkpoint_root(cfg.run_dir))


def damaged(manifest: dict[str, Any], present: dict[str, int]) -> str | None:
    """Why a checkpoint with this manifest is not usable, given the files present (name -> size)."""
    sizes = manifest.get("sizes", {})
    for name in manifest.get("files", []):
        if name not in present:
            return f"file {name} is missing"
        if name in sizes and present[name] != sizes[name]:
            return f"file {name} has {present[name]} bytes, the manifest says {sizes[name]}"
    return None


def list_complete_at(root: str | Path, problems: list[str] | None = None) -> list[CheckpointInfo]:
    """Complete checkpoints under `root` (a path or a URL), oldest first: a manifest that parses and
    lists files that are all there (with their recorded sizes, where the manifest has them). Why an
    incomplete one with a manifest was skipped goes into `problems`."""
    local = "://" not in str(root)  # URLs (file:// too) stay strings
    out = []
    entries = cio.list_dir(str(root))
    for name in sorted(entries):
        match = STEP_DIR_RE.match(name)
        if not match or entries[name] != -1:
            continue
        directory = cio.join(root, name)
        present = cio.list_dir(directory)
        if MANIFEST not in present:
            continue
        try:
            manifest = json.loads(cio.read_text(cio.join(directory, MANIFEST)))
        except (OSError, ValueError) as exc:
            if problems is not None:
                problems.append(f"{directory}: unreadable {MANIFEST} ({exc})")
            continue
        why = damaged(manifest, present)
        if why is not None:
            if problems is not None:
                problems.append(f"{directory}: {why}")
            continue
        out.append(CheckpointInfo(int(match.group(1)), Path(directory) if local else directory, manifest))  # type: ignore[arg-type]
    return sorted(out, key=lambda c: c.step)


def list_complete(run_dir: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints in RUN/checkpoints, oldest first."""
    return list_complete_at(checkpoint_root(run_dir))


def latest_complete_at(root: str | Path, step: int | None = None,
                       problems: list[str] | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint under `root` (or the one of `step`, if complete)."""
    done = [c for c in list_complete_at(root, problems) if step is None or c.step == step]
    return done[-1] if done else None


def latest_complete(run_dir: str | Path, root: str | Path | None = None) -> CheckpointInfo | None:
    return latest_complete_at(root if root is not None else checkpoint_root(run_dir))


def publish_manifest(directory: str, fields: dict[str, Any]) -> None:
    """Rank 0, once every file of a checkpoint is written: the manifest (last), listing the files and
    their sizes, so a truncated or missing file makes the checkpoint incomplete."""
    present = {n: size for n, size in cio.list_dir(directory).items()
               if size >= 0 and n != MANIFEST and ".tmp" not in n}
    manifest = {**fields, "files": sorted(present), "sizes": present, "bytes": sum(present.values()),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    cio.write_text_atomic(cio.join(directory, MANIFEST), json.dumps(manifest, indent=2, default=str))


def prune_at(root: str | Path, keep_last: int) -> None:
    """Keep the last keep_last complete checkpoints; drop older and abandoned (incomplete) ones."""
    complete = list_complete_at(root)
    if not complete:
        return
    keep = {c.step for c in complete[-max(1, keep_last):]}
    newest = complete[-1].step
    for name in cio.list_dir(str(root)):
        match = STEP_DIR_RE.match(name)
        if match and int(match.group(1)) not in keep and int(match.group(1)) < newest:
            cio.remove_tree(cio.join(root, name))


def drop_newer_at(root: str | Path, step: int) -> None:
    """Saves newer than the chosen checkpoint are leftovers of a crashed attempt (see _drop_newer_than)."""
    for name in cio.list_dir(str(root)):
        match = STEP_DIR_RE.match(name)
        if match and int(match.group(1)) > step:
            cio.remove_tree(cio.join(root, name))


def check_resumable(info: CheckpointInfo, cfg: JobConfig) -> None:
    """Refuse a checkpoint saved with another layout, model or optimizer, saying what to do."""
    saved, now = info.manifest.get("layout", {}), layout_of(cfg)
    reshardable = info.manifest.get("format") == "dcp"
    free = RESHARDABLE if reshardable else ()
    diff = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in now if k not in free and saved.get(k) != now[k]]
    if diff and reshardable:
        raise CheckpointLayoutError(
            f"checkpoint {info.path} was saved with a different layout ({'; '.join(diff)}). It reshards "
            f"across {' and '.join(RESHARDABLE)} only: rerun with the saved tp/pp/vpp, bucket_mb, model and "
            "optimizer, or start fresh with a new --run-dir")
    if diff:
        raise CheckpointLayoutError(
            f"checkpoint {info.path} was saved with a different layout ({'; '.join(diff)}). Resuming "
            "across a layout change is not supported: rerun with the saved settings, or start fresh "
            "with a new --run-dir (or move RUN/checkpoints away)")


@dataclass
class _Job:
    step: int
    tree: dict[str, Any]
    ready: Any  # a CUDA event the host copies complete at, or None
    done: threading.Event = field(default_factory=threading.Event)


class CheckpointManager:
    """Saves and restores one rank's training state. mode='async' is the two-stage save; 'sync'
    persists in the training thread (the baseline the benchmark compares against)."""

    def __init__(self, cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device,
                 mode: str = "async") -> None:
        if mode not in ("async", "sync"):
            raise ValueError(f"checkpoint mode '{mode}' unknown; use async or sync")
        self.cfg, self.dims, self.rank, self.device, self.mode = cfg, dims, rank, device, mode
        self.run_dir = Path(cfg.run_dir)
        self.layout = layout_of(cfg)
        self.coords = dims.coords(rank)
        self.is_writer = self.coords.dp in writer_dp_ranks(self.layout)
        self.stalls_s: list[float] = []
        """Training-thread time of each save (snapshot + waiting for the previous write)."""
        self.write_s: list[float] = []
        self.errors: list[str] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: _Job | None = None
        self._thread: threading.Thread | None = None
        if mode == "async" and self.is_writer:
            self._thread = threading.Thread(target=self._writer_loop, name="megascope-ckpt", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any) -> float:
        """Checkpoint the state after `step` completed steps. Returns the training-thread stall (s)."""
        t0 = time.perf_counter()
        with tracing.span("checkpoint_snapshot", kind="host"):
            state.optimizer.wait_param_sync()  # the prefetched all-gathers must not race the copy
            if self.is_writer:
                self._wait_pending()  # back-pressure: the host buffers are reused
                tree = self._state_tree(step, state)
                if self.mode == "sync":
                    self._persist(_Job(step, tree, None))
                else:
                    tree, ready = host_snapshot(tree, self._buffers)
                    self._pending = _Job(step, tree, ready)
                    self._jobs.put(self._pending)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        return stall

    def _state_tree(self, step: int, state: Any) -> dict[str, Any]:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"format": FORMAT, "step": step, "coords": vars(self.coords).copy(),
                "optimizer": state.optimizer.state_dict(), "rng": rng}

    def _wait_pending(self) -> None:
        if self._pending is not None:
            self._pending.done.wait()
            self._pending = None

    def _writer_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._persist(job)
            except Exception as exc:  # a failed save must not kill training; the previous one stays
                self.errors.append(f"step {job.step}: {exc!r}")
                print(f"[megascope] rank {self.rank}: checkpoint at step {job.step} failed: {exc!r}",
                      flush=True)
            finally:
                job.done.set()

    def _persist(self, job: _Job) -> None:
        t0 = time.perf_counter()
        if job.ready is not None:
            job.ready.synchronize()  # the device-to-host copies of stage 1 (writer thread only)
        directory = step_dir(self.run_dir, job.step)
        directory.mkdir(parents=True, exist_ok=True)
        c = self.coords
        nbytes = save_file(job.tree, directory / shard_name(c.pp, c.tp, c.dp))
        self.write_s.append(time.perf_counter() - t0)
        if self.rank == 0:
            self._publish(job.step, directory, nbytes, t0)

    def _publish(self, step: int, directory: Path, own_bytes: int, t0: float) -> None:
        """Rank 0: once every shard is in place, write the manifest (last) and prune old checkpoints."""
        files = expected_files(self.layout)
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while not all((directory / f).is_file() for f in files):
            if time.monotonic() > deadline:
                raise TimeoutError(f"shards of {directory} incomplete after {PUBLISH_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        write_json_atomic(directory / MANIFEST, {
            "format": FORMAT, "step": step, "layout": self.layout, "files": files,
            "bytes": sum((directory / f).stat().st_size for f in files), "world": self.dims.world_size,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": self.mode,
            "stall_s_rank0": self.stalls_s[-1] if self.stalls_s else None,
            "persist_s_rank0": time.perf_counter() - t0})
        self.prune()

    def prune(self) -> None:
        """Keep the last keep_last complete checkpoints; drop older and abandoned (incomplete) ones."""
        complete = list_complete(self.run_dir)
        if not complete:
            return
        keep = {c.path for c in complete[-max(1, self.cfg.robust.keep_last):]}
        newest = complete[-1].step
        for entry in checkpoint_root(self.run_dir).iterdir():
            match = STEP_DIR_RE.match(entry.name)
            if match and entry not in keep and int(match.group(1)) < newest:
                shutil.rmtree(entry, ignore_errors=True)

    def close(self) -> None:
        """Wait until this rank's last save is persisted (and, on rank 0, published)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ restore

    def resume(self, state: Any) -> int:
        """Load the latest complete checkpoint into `state`; returns the step to continue from (0 if
        none). Collective: every rank calls it; rank 0 picks the checkpoint for everyone."""
        info = latest_complete(self.run_dir) if self.rank == 0 else None
        step = torch.tensor([info.step if info is not None else -1], dtype=torch.int64, device=self.device)
        comm.broadcast(step, 0, self.dims.groups["world"], "world", name="checkpoint_pick")
        chosen = int(step.item())  # note: this is a CPU-GPU sync point (once, at start-up)
        if self.rank == 0:
            self._drop_newer_than(chosen)
        dist.barrier(self.dims.groups["world"])  # nobody reads while rank 0 tidies
        if chosen < 0:
            return 0
        info = CheckpointInfo(chosen, step_dir(self.run_dir, chosen),
                              json.loads((step_dir(self.run_dir, chosen) / MANIFEST).read_text()))
        check_resumable(info, self.cfg)
        with tracing.span("checkpoint_restore", kind="host"):
            tree = self._read_and_share(info)
            state.optimizer.load_state_dict(tree["optimizer"])
            torch.set_rng_state(tree["rng"]["cpu"].cpu())
            if self.device.type == "cuda" and "cuda" in tree["rng"]:
                torch.cuda.set_rng_state(tree["rng"]["cuda"].cpu(), self.device)
        return chosen

    def _read_and_share(self, info: CheckpointInfo) -> dict[str, Any]:
        """dp rank 0 reads every shard file of its (pp, tp) and broadcasts each to the dp group; each
        rank keeps its own (its dp index, or the only file when replicas are identical)."""
        c = self.coords
        reader = self.dims.rank_of(c.pp, 0, c.tp)
        writers = writer_dp_ranks(self.layout)
        mine = None
        for d in writers:
            tree = None
            if self.rank == reader:
                tree = torch.load(info.path / shard_name(c.pp, c.tp, d), map_location="cpu", weights_only=True)
            if self.dims.dp > 1:
                tree = broadcast_tree(tree, reader, self.dims.groups["dp"], self.device)
            if d == c.dp or len(writers) == 1:
                mine = tree
        if mine is None or mine.get("format") != FORMAT:
            raise CheckpointLayoutError(f"{info.path}: no usable shard for pp={c.pp} tp={c.tp} dp={c.dp}")
        return mine

    def _drop_newer_than(self, step: int) -> None:
        """Directories of saves newer than the chosen checkpoint are leftovers of a crashed attempt;
        this attempt will write those steps again, so stale shards must not complete them."""
        root = checkpoint_root(self.run_dir)
        if not root.is_dir():
            return
        for entry in root.iterdir():
            match = STEP_DIR_RE.match(entry.name)
            if match and int(match.group(1)) > step:
                shutil.rmtree(entry, ignore_errors=True)
