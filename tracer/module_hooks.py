"""Compute, optimizer and data-wait spans of a job megascope did not write, from hooks: nothing in
the model, the optimizer or the loop is edited.

- forward: a forward pre-hook (prepended, so it runs before FSDP's all-gather hook and the span
  holds it) opens a `forward` span and counts the micro-batch (the n-th forward of the step); a
  forward hook (always called, also when forward raises) closes it.
- backward: the forward hook puts a gradient hook on the first output that requires grad; when the
  gradient of that output is computed (backward has reached the model) it opens a `backward` span
  for that micro-batch and queues an autograd engine callback, which closes the span when the
  backward pass ends (before DDP's or FSDP's own end-of-backward callbacks, queued later, wait for
  their last buckets). The loss's own backward, outside the model, is not in the span.
- optimizer: step pre/post hooks of the optimizer, a compute span `optimizer` (as the trainer's).
- data wait: `TracedLoader` times each `next()` on the loader's iterator as a host span `data_wait`.
A forward that runs inside a backward pass (activation checkpointing recomputing) is part of that
backward: no forward span, no micro-batch.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from megascope.tracer import api


class StepCounter:
    """Micro-batches seen in the current step (reset by the attachment at each step)."""

    def __init__(self) -> None:
        self.microbatches = 0

    def next_microbatch(self) -> int:
        mb = self.microbatches
        self.microbatches = mb + 1
        return mb


class ModelHooks:
    """forward / backward spans per micro-batch of one module (the model, or a pipeline stage)."""

    def __init__(self, model: torch.nn.Module, counter: StepCounter) -> None:
        self.counter = counter
        self._open: list[tuple[api.span, int] | None] = []
        self.handles = [model.register_forward_pre_hook(self._before, prepend=True),
                        model.register_forward_hook(self._after, always_call=True)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        tracer = api._active
        if tracer is None or torch._C._current_graph_task_id() != -1:  # recompute inside backward
            self._open.append(None)
            return
        mb = self.counter.next_microbatch()
        tracer.microbatch, tracer.chunk = mb, -1  # api.set_microbatch, inlined
        forward = api.span("forward", microbatch=mb)
        forward.__enter__()
        self._open.append((forward, mb))

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        entry = self._open.pop() if self._open else None
        if entry is None:
            return
        forward, mb = entry
        forward.__exit__(None, None, None)
        tracer = api._active
        if tracer is None or not tracer.recording or not torch.is_grad_enabled():
            return
        leaves = (output,) if isinstance(output, torch.Tensor) else tree_leaves(output)  # pytree: ~10 us
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, mb=mb: _backward_begins(mb))
                return


def _backward_begins(mb: int) -> None:
    tracer = api._active
    if tracer is None:
        return
    tracer.microbatch = mb  # comm issued during this backward (DDP buckets, FSDP reduce-scatters)
    backward = api.span("backward", microbatch=mb)
    backward.__enter__()

    def end_backward() -> None:  # runs when the engine has finished this backward
        backward.__exit__(None, None, None)

    Variable._execution_engine.queue_callback(end_backward)


class OptimizerHooks:
    """An `optimizer` compute span around each optimizer.step()."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._open: api.span | None = None
        self.handles = [optimizer.register_step_pre_hook(self._before),
                        optimizer.register_step_post_hook(self._after)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # a step that raised never reached its post-hook: its span is dropped, not closed here
        self._open = api.span("optimizer")
        self._open.__enter__()

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


class TracedLoader:
    """Iterates `loader`, timing each fetch as a host span `data_wait` (len() as the loader's).
    The fetch that finds the loader exhausted is not recorded: it belongs to no training step."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        it = iter(self.loader)
        while True:
            wait = api.span("data_wait", kind="host")
            wait.__enter__()
            try:
                item = next(it)
            except StopIteration:
                return
            wait.__exit__(None, None, None)
            yield item

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, batch_size, ... of the loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
