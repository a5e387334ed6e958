"""Checkpoints through torch.distributed.checkpoint (DCP): asynchronous, to a local path or an fsspec
URL, and reshardable across data parallelism (a job restarted with fewer dp replicas resumes).

What is saved, per (pp, tp) and per gradient bucket of each model chunk, as one logical 1-D tensor of
the bucket's parameters (padding left out): the fp32 master weights and the optimizer's moments
(AdamW and LAMB keep the same state). With ZeRO each dp rank holds the torch.chunk-style slice d of
every bucket (grad_buckets pads a bucket to a multiple of dp and rank d owns elements
[d*ceil(n/dp), (d+1)*ceil(n/dp))), which is exactly a DTensor sharded on dim 0 over the dp group: DCP
writes each slice once and, on load, reads whatever overlaps the slice the new layout asks for. Without
ZeRO (or at dp=1) every rank holds whole buckets: plain tensors, written once (DCP deduplicates). So dp
and zero may change between save and resume; tp, pp, vpp, bucket_mb, the model and the optimizer may
not (the bucket keys depend on them). Model weights are not saved: they are the master weights, cast
and all-gathered on load. Every rank also saves its CPU (and CUDA) RNG state; a rank whose coordinates
did not exist at save time takes dp replica 0's.

    CKPT/step-000040/.metadata, __0_0.distcp, ...   DCP's files (.metadata last, by rank 0)
    CKPT/step-000040/manifest.json                  ours, after .metadata: layout, files and their sizes

A save keeps the two-stage snapshot's stall: the training thread waits for the previous save, copies
the state into reusable host buffers (checkpoint_io.host_snapshot: pinned on GPU, copies enqueued on
the stream, no device sync) and hands those to `dcp.async_save` with a stager that only waits for the
copies (DCP's default stager would copy everything a second time, and deep-copies DTensors, which
fails for views of a flat buffer); a background thread plans and writes, coordinating over a gloo
group of its own (never the training group, which the training thread keeps using). Rank 0 writes the manifest
once DCP is done; only a directory whose manifest lists files of the recorded sizes counts (checkpoint.py
list_complete), so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megascope import tracer as tracing
from megascope.tracer import comm
from megascope.trainer.config import JobConfig
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.robust import checkpoint_io as cio
from megascope.trainer.robust.checkpoint import (
    check_resumable,
    checkpoint_home,
    drop_newer_at,
    latest_complete_at,
    layout_of,
    prune_at,
    publish_manifest,
)

FORMAT = "dcp"
FIELDS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointReadError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line with what to do."""


@dataclass
class _Bucket:
    key: str
    """optim/pp{pp}/tp{tp}/chunk{c}/bucket{b}"""
    numel: int
    """The bucket's parameters' elements (no padding)."""
    lo: int
    """First element of this rank's part in the optimizer's flat master/moment tensors."""
    length: int
    """Elements this rank holds (its ZeRO slice without padding, or the whole bucket)."""
    sharded: bool


def bucket_entries(optimizer: Any, coords: Any, dp: int) -> list[_Bucket]:
    """Where each bucket's saved elements live in this rank's flat optimizer tensors."""
    out = []
    sharded = bool(optimizer.zero) and dp > 1
    for chunk in optimizer.chunks:
        for bucket in chunk.buckets:
            lo, _ = optimizer._master_index[bucket]
            numel = sum(slot.numel for slot in bucket.slots)
            if sharded:
                size = bucket.shard_size
                length = max(0, min(size, numel - optimizer.dp_rank * size))
            else:
                length = numel
            out.append(_Bucket(f"optim/pp{coords.pp:03d}/tp{coords.tp:03d}/chunk{chunk.chunk:03d}/"
                               f"bucket{bucket.index:04d}", numel, lo, length, sharded))
    return out


def rng_key(pp: int, tp: int, dp: int, kind: str) -> str:
    return f"rng/pp{pp:03d}/tp{tp:03d}/dp{dp:03d}/{kind}"


class DcpCheckpointManager:
    """Save and restore one rank's training state with DCP. Same interface as CheckpointManager
    (save, close, resume, stalls_s, write_s, errors); every rank calls save/resume/close."""

    def __init__(self, cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device) -> None:
        self.cfg, self.dims, self.rank, self.device = cfg, dims, rank, device
        self.root = checkpoint_home(cfg)
        self.layout = layout_of(cfg)
        self.coords = dims.coords(rank)
        self.stalls_s: list[float] = []
        """Training-thread time of each save (waiting for the previous one + staging + submitting)."""
        self.write_s: list[float] = []
        """Background time of each save, staging to done (this rank's view)."""
        self.errors: list[str] = []
        # DCP coordinates a save with collectives from its background thread: a gloo group of its own
        # keeps them apart from the training thread's collectives (and works when training uses NCCL)
        self.group = dist.new_group(backend="gloo")
        self._mesh = None
        if dims.dp > 1:
            from torch.distributed.device_mesh import DeviceMesh

            # a CPU mesh whatever the training device: the DTensors wrap host buffers (DTensor.from_local
            # would move them to a CUDA mesh's device); DCP only reads its coordinates, never communicates
            self._mesh = DeviceMesh.from_group(dims.groups["dp"], "cpu")
            self._dtensor(torch.empty(0, device="cpu"), 0)  # the first DTensor imports torch._dynamo (~1 s): now
        self._pending: Future | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        """Host copies of the state, reused by every save (the previous save is finished first)."""
        self._wrapped: dict[str, tuple[torch.Tensor, Any]] = {}
        import torch.distributed.checkpoint as _dcp  # noqa: F401 - at start-up, not in the first save's stall
        self._published = threading.Event()
        self._published.set()

    # ------------------------------------------------------------------ state dict

    def _state_dict(self, optimizer: Any, step: int | None, wrap: bool = True) -> tuple[dict[str, Any], list[_Bucket]]:
        """This rank's view of the checkpoint: tensors are views of the optimizer's own tensors."""
        entries = bucket_entries(optimizer, self.coords, self.dims.dp)
        inner = optimizer.optimizer
        flat = {"master": optimizer.master, "exp_avg": inner.exp_avg, "exp_avg_sq": inner.exp_avg_sq}
        sd: dict[str, Any] = {}
        for e in entries:
            for name in FIELDS:
                local = flat[name][e.lo:e.lo + e.length]
                sd[f"{e.key}/{name}"] = self._dtensor(local, e.numel) if e.sharded and wrap else local
        c = self.coords
        sd[f"optim/pp{c.pp:03d}/tp{c.tp:03d}/step_count"] = int(inner.step_count)
        sd[rng_key(c.pp, c.tp, c.dp, "cpu")] = torch.get_rng_state()
        if self.device.type == "cuda":
            sd[rng_key(c.pp, c.tp, c.dp, "cuda")] = torch.cuda.get_rng_state(self.device)
        if step is not None:
            sd["step"] = step
        return sd, entries

    def _snapshot(self, optimizer: Any, step: int) -> tuple[dict[str, Any], Any]:
        """The state dict over host copies in reused buffers; the CUDA event they complete at (or None)."""
        sd, entries = self._state_dict(optimizer, step, wrap=False)
        copied, ready = cio.host_snapshot(sd, self._buffers)
        sharded = {f"{e.key}/{name}": e.numel for e in entries if e.sharded for name in FIELDS}
        out = {}
        for key, value in copied.items():
            if key in sharded:  # the DTensor wrapping a reused buffer is reused too (no per-save dispatch)
                cached = self._wrapped.get(key)
                if cached is None or cached[0] is not value:
                    cached = (value, self._dtensor(value, sharded[key]))
                    self._wrapped[key] = cached
                value = cached[1]
            out[key] = value
        return out, ready

    def _dtensor(self, local: torch.Tensor, numel: int) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, self._mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([numel]), stride=(1,))

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any) -> float:
        """Checkpoint the state after `step` completed steps; returns the training-thread stall (s)."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        with tracing.span("checkpoint_snapshot", kind="host"):
            state.optimizer.wait_param_sync()
            self._wait_pending()  # back-pressure: one save in flight
            sd, ready = self._snapshot(state.optimizer, step)
            path = cio.join(self.root, cio.step_name(step))
            self._published.clear()
            started = time.perf_counter()
            future: Any = None
            try:
                cio.makedirs(path)
                future = dcp.async_save(sd, storage_writer=cio.dcp_writer(path), process_group=self.group,
                                        async_stager=_Prestaged(ready))
            except Exception as exc:  # a failed save must not kill training; the previous one stays
                self._failed(step, exc)
                self._published.set()
                future = None
            if future is not None:
                # a stager that returns a Future (ours, on GPU) makes async_save answer an AsyncSaveResponse
                upload: Future = getattr(future, "upload_completion", future)
                self._pending = upload
                upload.add_done_callback(lambda f: self._done(f, step, path, started, t0))
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        return stall

    def _done(self, future: Future, step: int, path: str, started: float, t0: float) -> None:
        try:
            future.result()
            self.write_s.append(time.perf_counter() - started)
            if self.rank == 0:
                publish_manifest(path, {"format": FORMAT, "step": step, "layout": self.layout,
                                        "world": self.dims.world_size, "mode": "dcp-async",
                                        "stall_s_rank0": self.stalls_s[-1] if self.stalls_s else None,
                                        "persist_s_rank0": time.perf_counter() - t0})
                prune_at(self.root, self.cfg.robust.keep_last)
        except Exception as exc:  # noqa: BLE001 - logged and counted; training goes on
            self._failed(step, exc)
        finally:
            self._published.set()

    def _failed(self, step: int, exc: BaseException) -> None:
        self.errors.append(f"step {step}: {exc!r}")
        print(f"[megascope] rank {self.rank}: checkpoint at step {step} failed: {exc!r}", flush=True)

    def _wait_pending(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception:  # noqa: BLE001 - reported by the callback
                pass
            self._pending = None
        self._published.wait()

    def close(self) -> None:
        """Wait until the last save is written (and, on rank 0, published)."""
        self._wait_pending()

    # ------------------------------------------------------------------ restore

    def resume(self, state: Any) -> int:
        """Load the latest complete checkpoint into `state`, resharding across dp when the layout
        changed; returns the step to continue from (0 if none). Collective."""
        info = latest_complete_at(self.root) if self.rank == 0 else None
        step = torch.tensor([info.step if info is not None else -1], dtype=torch.int64, device=self.device)
        comm.broadcast(step, 0, self.dims.groups["world"], "world", name="checkpoint_pick")
        chosen = int(step.item())  # note: a CPU-GPU sync point (once, at start-up)
        if self.rank == 0:
            drop_newer_at(self.root, chosen)
        dist.barrier(self.dims.groups["world"])  # nobody reads while rank 0 tidies
        if chosen < 0:
            return 0
        info = latest_complete_at(self.root, step=chosen)
        if info is None:
            raise CheckpointReadError(f"checkpoint step {chosen} under {self.root} vanished while resuming; "
                                      "restart the job (it picks the latest complete one again)")
        check_resumable(info, self.cfg)
        with tracing.span("checkpoint_restore", kind="host"):
            self._load(state.optimizer, info)
        return chosen

    def _load(self, optimizer: Any, info: Any) -> None:
        import torch.distributed.checkpoint as dcp

        optimizer.wait_param_sync()
        reader = cio.dcp_reader(str(info.path))
        try:
            saved = reader.read_metadata().state_dict_metadata
        except Exception as exc:  # noqa: BLE001 - a damaged .metadata: one clear line
            raise CheckpointReadError(f"checkpoint {info.path} is damaged ({type(exc).__name__}: {exc}); "
                                      "remove that step directory to resume from the one before") from None
        sd, entries = self._state_dict(optimizer, None)
        c = self.coords
        for kind in ("cpu", "cuda"):
            mine = rng_key(c.pp, c.tp, c.dp, kind)
            if mine in sd and mine not in saved:  # a dp replica that did not exist: replica 0's stream
                sd[rng_key(c.pp, c.tp, 0, kind)] = sd.pop(mine)
        missing = [k for k in sd if k not in saved]
        if missing:
            raise CheckpointReadError(f"checkpoint {info.path} lacks {len(missing)} entries this layout needs "
                                      f"(e.g. {missing[0]}); it was saved with another model, tp/pp/vpp or "
                                      "bucket_mb: resume with those settings or start a new --run-dir")
        try:
            dcp.load(sd, storage_reader=reader, process_group=self.group)
        except Exception as exc:  # noqa: BLE001 - a damaged data file: one clear line
            raise CheckpointReadError(f"checkpoint {info.path} cannot be read ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}); remove that step "
                                      "directory to resume from the one before") from None
        inner = optimizer.optimizer
        flat = {"master": optimizer.master, "exp_avg": inner.exp_avg, "exp_avg_sq": inner.exp_avg_sq}
        for e in entries:
            for name in FIELDS:
                value = sd[f"{e.key}/{name}"]
                value = value.to_local() if hasattr(value, "to_local") else value
                flat[name][e.lo:e.lo + e.length].copy_(value)  # a no-op where DCP loaded in place
        step_count = int(sd[f"optim/pp{c.pp:03d}/tp{c.tp:03d}/step_count"])
        # the optimizer's own loader re-gathers the parameters from the (now loaded) master weights
        optimizer.load_state_dict({"master": optimizer.master, "optimizer": {
            "step": step_count, "exp_avg": inner.exp_avg, "exp_avg_sq": inner.exp_avg_sq}})
        for kind, value in ((k.rsplit("/", 1)[1], v) for k, v in sd.items() if k.startswith("rng/")):
            if kind == "cpu":
                torch.set_rng_state(value.cpu())
            elif self.device.type == "cuda":
                torch.cuda.set_rng_state(value.cpu(), self.device)


class _Prestaged:
    """A DCP stager (torch.distributed.checkpoint.staging.AsyncStager) for a state dict that already
    lives in our host buffers: staging is only waiting for the device-to-host copies, on a helper
    thread, so the training thread never waits for the device."""

    _synchronize_after_execute = False

    def __init__(self, ready: Any) -> None:
        self.ready = ready

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> Any:
        if self.ready is None:
            return state_dict
        staged: Future = Future()

        def wait() -> None:
            try:
                self.ready.synchronize()
                staged.set_result(state_dict)
            except BaseException as exc:  # noqa: BLE001 - handed to the save, which reports it
                staged.set_exception(exc)

        threading.Thread(target=wait, name="megascope-ckpt-stage", daemon=True).start()
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
