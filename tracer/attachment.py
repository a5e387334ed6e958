"""Trace a PyTorch job megascope did not write: the public entry point, `megascope.tracer.attach`.

    from megascope import tracer

    with tracer.attach("runs/my-job", model=model, optimizer=opt) as t:   # dp/tp/pp/cp=, or layout=mesh
        for batch in t.data(loader):
            loss = model(batch).mean(); loss.backward(); opt.step(); opt.zero_grad()
            t.step()                                     # like torch.profiler.profile's step()

Modeled on torch.profiler.profile: a context manager (or start()/close()), and step() at the end of
each training step. Entering it, on every rank (a collective over the world group):
  1. the layout: dp/tp/pp/cp sizes, a DeviceMesh, or the default world = dp (attach_topology.py);
  2. a refusal, on every rank at once, when any rank's run directory already holds a run (mixing two
     runs' segments would corrupt both), before anything is written;
  3. rank 0 writes run.json (topology with every rank's host, source "megascope-attach");
  4. a Tracer per rank (tracer/core.py), activated, clocks synced to rank 0 (tracer/clock_sync.py);
  5. the torch.distributed collectives and p2p functions traced (dist_intercept.py), a DDP
     communication hook on a DistributedDataParallel model (ddp_hook.py), forward/backward spans from
     module hooks on the model and an optimizer span from optimizer step hooks (module_hooks.py).
Leaving it, also on an exception in the job: every hook is removed and the original torch.distributed
functions are back, the tracer is flushed and closed (segments are written whole or not at all), and
rank 0 notes in run.json whether the job completed or failed. Closing does no collective, so a rank
that fails alone closes without waiting for the others. A DDP communication hook cannot be removed:
after close it only runs DDP's default all-reduce.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from megascope.tracer import api, ddp_hook
from megascope.tracer import run_dir as rundir
from megascope.tracer.attach_topology import AttachLayout, resolve
from megascope.tracer.config import TraceConfig
from megascope.tracer.core import Tracer
from megascope.tracer.dist_intercept import DistInterceptor
from megascope.tracer.module_hooks import ModelHooks, OptimizerHooks, StepCounter, TracedLoader

log = logging.getLogger("megascope.tracer")
SOURCE = "megascope-attach"
NOTHING_HOOKED = ("attach: no model= or optimizer= given, so only step boundaries and what your code records "
                  "itself (tracer.span, torch.distributed calls made from Python) are traced: a DDP model's "
                  "gradient all-reduces and its forward, backward and optimizer steps are not, and `megascope "
                  "analyze` may have nothing to judge. Pass attach(run_dir, model=model, optimizer=optimizer), "
                  "or call .watch(model, optimizer) before the first step.")
"""Warned at attach time on rank 0 when nothing is hooked (issue 31 item 4: such a run analyzed as "Findings:
none", as if healthy; `analyze` now says it has no verdict)."""


class Attachment:
    """A traced job: see the module docstring. Build it with `attach(...)`."""

    def __init__(self, run_dir: str | Path, layout: Any = None, *, dp: int | None = None,
                 tp: int | None = None, pp: int | None = None, cp: int | None = None,
                 model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 config: TraceConfig | None = None, device: torch.device | str | None = None,
                 intercept: bool = True, sync_clocks: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self._sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
        self._layout_arg = layout
        self.model, self.optimizer = model, optimizer
        self.config = config
        self.device = device
        self.intercept, self.sync = intercept, sync_clocks
        self.rank, self.world = 0, 1
        self.layout: AttachLayout | None = None
        self.tracer: Tracer | None = None
        self.interceptor: DistInterceptor | None = None
        self.ddp_hooked = False
        self.counter = StepCounter()
        self._hooks: list[Any] = []
        self.current_step = 0
        self.started = self.closed = False

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "Attachment":
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)  # returns None: an exception inside the block propagates

    def start(self) -> "Attachment":
        """Collective over the world group: every rank calls it at the same point."""
        if self.started:
            raise RuntimeError("attach: already started")
        self.started = True
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = resolve(self.world, self._layout_arg, **self._sizes)
        hosts, local_ranks = self._agree_on_run_dir()
        device = self._device()
        if self.rank == 0:
            self._write_manifest(hosts, local_ranks)
        try:
            cfg = self.config or TraceConfig(nvml=device.type == "cuda")
            self.tracer = Tracer(self.run_dir, self.rank, cfg, device)
            api.activate(self.tracer)
            if self.sync and self.world > 1:
                self.tracer.sync_clocks()
            if self.intercept and self.world > 1:
                self.interceptor = DistInterceptor(self.layout, self.rank)
                self.interceptor.install()
            self.watch(self.model, self.optimizer)
            if self.model is None and self.optimizer is None and self.rank == 0:
                log.warning(NOTHING_HOOKED)
            api.set_step(0)
        except BaseException as exc:
            self.close(exc)
            raise
        return self

    def watch(self, model: torch.nn.Module | None = None,
              optimizer: torch.optim.Optimizer | None = None) -> None:
        """Hook a model (forward/backward spans; the DDP hook on a DDP model) or an optimizer given
        after attach (e.g. wrapped later). A DDP model takes its hook before its first backward."""
        if model is not None:
            self._hooks.append(ModelHooks(model, self.counter))
            # world > 1 only once start() has set the layout
            if (self.world > 1 and self.layout is not None
                    and isinstance(model, torch.nn.parallel.DistributedDataParallel)):
                self.ddp_hooked = ddp_hook.register(model, self.layout)
        if optimizer is not None:
            self._hooks.append(OptimizerHooks(optimizer))

    def step(self, tokens: int = 0, loss: float | torch.Tensor = math.nan, lr: float = math.nan,
             grad_norm: float = math.nan, model_flops: float = math.nan) -> None:
        """End of a training step: its steps-table row, then the next step begins. A tensor loss is
        read with .item() (a device sync on GPU); pass a float you already have to avoid it."""
        if self.tracer is None or self.closed:
            return
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach().item())
        api.record_step(tokens=tokens, loss=loss, lr=lr, grad_norm=grad_norm, model_flops=model_flops)
        self.current_step += 1
        self.counter.microbatches = 0
        every = self.tracer.cfg.clock_sync_every
        if self.sync and self.world > 1 and every > 0 and self.current_step % every == 0:
            self.tracer.sync_clocks()  # every rank reaches the same step: a step boundary for all
        api.set_step(self.current_step)

    def data(self, loader: Iterable) -> TracedLoader:
        """`loader`, each fetch timed as a `data_wait` span."""
        return TracedLoader(loader)

    def close(self, error: BaseException | None = None) -> None:
        """Remove hooks, restore torch.distributed, flush and close the tracer; idempotent, no collective."""
        if self.closed or not self.started:
            return
        self.closed = True
        for hooks in self._hooks:
            hooks.remove()
        self._hooks = []
        if self.interceptor is not None:
            self.interceptor.uninstall()
        if self.tracer is None:
            return
        if api.active() is self.tracer:
            api.deactivate()
        self.tracer.close()
        if self.rank == 0:
            self._note_end(error)

    # -- helpers --------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        if self.model is not None:
            param = next(self.model.parameters(), None)
            if param is not None:
                return param.device
        if self.world > 1 and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agree_on_run_dir(self) -> tuple[list[str], list[int]]:
        """Every rank's host and local rank; raises on every rank if any rank's run_dir is unusable."""
        mine = (socket.gethostname(), int(os.environ.get("LOCAL_RANK", self.rank)), _run_dir_problem(self.run_dir))
        info: list[Any] = [mine]
        if self.world > 1:
            info = [None] * self.world
            dist.all_gather_object(info, mine)
        problems = [f"rank {r}: {p}" if self.world > 1 else p for r, (_, _, p) in enumerate(info) if p]
        if problems:
            self.closed = True
            raise ValueError(problems[0])
        return [h for h, _, _ in info], [lr for _, lr, _ in info]

    def _write_manifest(self, hosts: list[str], local_ranks: list[int]) -> None:
        assert self.layout is not None
        rundir.write_manifest(self.run_dir, {
            "run_id": uuid.uuid4().hex,
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": SOURCE,
            "topology": self.layout.topology(hosts, local_ranks),
            "attach": {"model": type(self.model).__name__ if self.model is not None else None,
                       "optimizer": type(self.optimizer).__name__ if self.optimizer is not None else None,
                       "intercept": self.intercept, "status": "running"},
            "clock_offsets_ns": {},
            "versions": {"torch": torch.__version__, "python": platform.python_version(),
                         "cuda": torch.version.cuda,
                         "backend": str(dist.get_backend()) if self.world > 1 else None},
        })

    def _note_end(self, error: BaseException | None) -> None:
        try:
            manifest = rundir.read_manifest(self.run_dir, check_version=False)
            note = dict(manifest.get("attach") or {})
            note.update(status="failed" if error is not None else "completed", steps=self.current_step,
                        ddp_hook=self.ddp_hooked)
            if error is not None:
                note["error"] = f"{type(error).__name__}: {error}"[:500]
            rundir.update_manifest(self.run_dir, attach=note)
        except (OSError, ValueError) as exc:
            log.warning("tracer: could not note the end of the run in run.json (%s)", exc)


def _run_dir_problem(run_dir: Path) -> str:
    """What makes run_dir unusable for a new run ("" when it is fine)."""
    if run_dir.exists() and not run_dir.is_dir():
        return f"attach: run directory {run_dir} is a file; pass a directory path"
    held = rundir.run_entries(run_dir)
    if held:
        return (f"attach: {run_dir} already holds a run ({', '.join(held)}); pass a new directory or "
                "delete this one (two runs in one directory cannot be told apart)")
    return ""


def attach(run_dir: str | Path, layout: Any = None, **kwargs: Any) -> Attachment:
    """Trace the job running in this process into `run_dir` (see Attachment and docs/tracing.md).

    layout: a DeviceMesh, a dict of dp/tp/pp/cp sizes, or None (or give dp=, tp=, pp=, cp=); by
    default every rank is data parallel. model / optimizer: hooked for spans (a DDP model also gets
    the communication hook). config: a TraceConfig. intercept: trace torch.distributed calls.
    Use as `with attach(...) as t:` or `t = attach(...).start()` ... `t.close()`."""
    return Attachment(run_dir, layout, **kwargs)
