"""Trace a Hugging Face `transformers.Trainer` run: a TrainerCallback around megascope.tracer.attach.

    from megascope.tracer.hf_callback import MegascopeCallback
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(MegascopeCallback(trainer, "runs/hf-job"))      # dp=/tp=/... as for attach
    trainer.train()

Needs the optional extra `megascope[attach]` (transformers, accelerate). The callback takes the
trainer because callbacks are handed the unwrapped model: the module the training step calls, the
DistributedDataParallel wrapper that gets the communication hook, is `trainer.model_wrapped`, set
once training begins. On train begin it attaches (hooks on that module, on the torch optimizer inside
Accelerate's wrapper), at each optimizer step's end it calls `step()`, on train end it closes. Not
recorded: data waits (the Trainer iterates its loader inside its loop), and the close when training
raises (the Trainer calls no callback then: the tracer is flushed at exit, the interception stays).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from megascope.tracer.attachment import Attachment, attach


class MegascopeCallback(TrainerCallback):
    def __init__(self, trainer: Any, run_dir: str | Path, **attach_kwargs: Any) -> None:
        self.trainer, self.run_dir, self.attach_kwargs = trainer, run_dir, attach_kwargs
        self.attachment: Attachment | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        model = getattr(self.trainer, "model_wrapped", None) or kwargs.get("model")
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it
        self.attachment = attach(self.run_dir, model=model, optimizer=inner, **self.attach_kwargs).start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attachment is not None:
            self.attachment.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attachment is not None:
            self.attachment.close()
