"""Trace a PyTorch Lightning run: a `lightning.pytorch.Callback` around megascope.tracer.attach.

    from megascope.tracer.lightning_callback import MegascopeCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[MegascopeCallback("runs/pl-job")])  # dp=/tp=/... as for attach
    trainer.fit(model, loader)

Needs the optional extra `megascope[attach]` (lightning). On train start (every rank, after the
strategy set up the process group and wrapped the model) it attaches: hooks on the module the strategy
calls (`trainer.strategy.model`: the DistributedDataParallel wrapper under a DDP strategy, which gets
the communication hook). The `optimizer` span is the update alone: Lightning runs forward and backward
inside `optimizer.step(closure)`, so a span around step() (attach's optimizer hooks) would hold the
whole step; it opens at `on_before_optimizer_step` (after the closure) and closes at the optimizer's
step post-hook. A step is an optimizer step: at the end of each
training batch that advanced `trainer.global_step` it calls `step()` (with gradient accumulation the
batches in between are micro-batches of one step). On train end it closes; when training raises,
Lightning calls `on_exception` and the attachment closes with the error (run.json says failed). Not
recorded: data waits (Lightning iterates its loaders inside its loop). Subclasses the unified
`lightning` package's Callback: a `pytorch_lightning.Trainer` needs its own package's callback class.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from megascope.tracer import api
from megascope.tracer.attachment import Attachment, attach


class MegascopeCallback(pl.Callback):
    def __init__(self, run_dir: str | Path, **attach_kwargs: Any) -> None:
        self.run_dir, self.attach_kwargs = run_dir, attach_kwargs
        self.attachment: Attachment | None = None
        self._last_step = 0
        self._update: api.span | None = None
        self._handles: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model or pl_module
        self.attachment = attach(self.run_dir, model=model, **self.attach_kwargs).start()
        self._handles = [opt.register_step_post_hook(self._update_done) for opt in trainer.optimizers]
        self._last_step = trainer.global_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._update = api.span("optimizer")  # a step whose update raised never closes it: dropped
        self._update.__enter__()

    def _update_done(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._update is not None:
            self._update.__exit__(None, None, None)
            self._update = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.attachment is None or trainer.global_step == self._last_step:
            return  # an accumulation micro-batch: the optimizer has not stepped
        self._last_step = trainer.global_step
        self.attachment.step(loss=_loss_of(outputs))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(exception)

    def _close(self, error: BaseException | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.attachment is not None:
            self.attachment.close(error)


def _loss_of(outputs: Any) -> float | torch.Tensor:
    """The loss training_step returned (a tensor or {"loss": tensor}); NaN when it returned neither."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss if isinstance(loss, (torch.Tensor, float)) else math.nan
