"""The executor that runs a stage's pipeline schedule (trainer/pipelining/schedule_order.py) for one step:
forward and backward of each chunk, the transfers they imply, tracing and fault hooks."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from megascope import tracer as tracing
from megascope.trainer.pipelining.p2p import message_tag
from megascope.trainer.pipelining.schedule_order import BACKWARD, FORWARD, Action

if TYPE_CHECKING:
    from megascope.trainer.pipelining.p2p import PipeComm
    from megascope.trainer.robust.faults import Faults


class ScheduleExecutor:
    """Runs a stage's action list over one step's micro-batches: forward and backward of each chunk,
    the pipeline transfers they imply, and the optimizer's per-chunk gradient-sync switch.

    Receives are posted one action ahead (so the transfer overlaps the current compute) and sends are
    asynchronous (waited at the end of the step by `PipeComm.finish`). Each forward and backward is
    wrapped in the tracer's compute span, with the ambient micro-batch/chunk set, and in the fault
    injector's compute hook (a straggler stretches exactly this work).
    """

    def __init__(self, chunks: list, pipe: "PipeComm | None", pp: int, stage: int, n_micro: int,
                 set_grad_sync: Callable[[int, bool], None] | None = None,
                 faults: Faults | None = None, autocast: Callable[[], ContextManager] | None = None) -> None:
        self.chunks, self.pipe, self.pp, self.stage, self.n_micro = chunks, pipe, pp, stage, n_micro
        self.set_grad_sync = set_grad_sync
        self.faults = faults
        self.autocast = autocast or contextlib.nullcontext
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def run(self, actions: list[Action], tokens: torch.Tensor | None,
            targets: torch.Tensor | None) -> torch.Tensor | None:
        """tokens/targets: [n_micro, micro_batch, seq] (needed on the first/last virtual stage).
        Returns the mean loss over micro-batches (detached) on the last stage, else None."""
        self._saved.clear()
        self._loss_sum: torch.Tensor | None = None
        pending = self._post_recv(actions[0]) if actions else None
        try:
            for i, action in enumerate(actions):
                upcoming = self._post_recv(actions[i + 1]) if i + 1 < len(actions) else None
                _set_microbatch(action.microbatch, action.chunk)
                if action.kind == FORWARD:
                    self._forward(action, pending, tokens, targets)
                else:
                    self._backward(action, pending)
                pending = upcoming
        finally:
            _set_microbatch(-1, -1)
        if self._saved:
            raise RuntimeError(f"schedule left {len(self._saved)} forwards without a backward: {self._saved.keys()}")
        return self._loss_sum

    def _pipe(self) -> PipeComm:
        assert self.pipe is not None, "a stage with pipeline neighbours has a PipeComm"
        return self.pipe

    def _placement(self, chunk: int):
        return self.chunks[chunk].placement

    def _post_recv(self, action: Action):
        p = self._placement(action.chunk)
        if self.pipe is None:
            return None
        _set_microbatch(action.microbatch, action.chunk)  # the receive is traced under its consumer
        if action.kind == FORWARD and not p.is_first:
            return self.pipe.post_recv("forward", message_tag(p.virtual_stage, action.microbatch,
                                                              self.n_micro, "forward"))
        if action.kind == BACKWARD and not p.is_last:
            return self.pipe.post_recv("backward", message_tag(p.virtual_stage, action.microbatch,
                                                               self.n_micro, "backward"))
        return None

    def _forward(self, a: Action, pending, tokens: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        chunk, p = self.chunks[a.chunk], self._placement(a.chunk)
        if p.is_first:
            assert tokens is not None, "the first stage is given the tokens"
            x = tokens[a.microbatch]
        else:
            x = self._pipe().wait(pending).requires_grad_()
        with _compute_span("forward"), self._stretch(), self.autocast():
            out = chunk(x)
            if p.is_last:
                assert targets is not None, "the last stage is given the targets"
                # 1/m: the accumulated gradient is the mean over micro-batches, as in one big batch
                out = chunk.loss(out, targets[a.microbatch]) / self.n_micro
        self._saved[(a.chunk, a.microbatch)] = (x, out)
        if p.is_last:
            loss = out.detach()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        else:
            self._pipe().send(out, "forward", message_tag(p.virtual_stage + 1, a.microbatch, self.n_micro, "forward"))

    def _backward(self, a: Action, pending) -> None:
        p = self._placement(a.chunk)
        x, out = self._saved.pop((a.chunk, a.microbatch))
        grad = None if p.is_last else self._pipe().wait(pending)
        if self.set_grad_sync is not None:  # the data-parallel reduction runs on a chunk's last micro-batch
            self.set_grad_sync(a.chunk, a.microbatch == self.n_micro - 1)
        with _compute_span("backward"), self._stretch():
            torch.autograd.backward(out, grad_tensors=grad)
        if not p.is_first:
            assert x.grad is not None  # x is a received activation, made to require grad in _forward
            tag = message_tag(p.virtual_stage - 1, a.microbatch, self.n_micro, "backward")
            self._pipe().send(x.grad, "backward", tag)

    def _stretch(self) -> ContextManager:
        if self.faults is None:
            return contextlib.nullcontext()
        return self.faults.compute()


def _set_microbatch(microbatch: int, chunk: int) -> None:
    setter = getattr(tracing, "set_microbatch", None)  # no-op until/unless the tracer provides it
    if setter is not None:
        setter(microbatch, chunk)


def _compute_span(name: str) -> ContextManager:
    span = getattr(tracing, "span", None)
    return span(name, kind="compute") if span is not None else contextlib.nullcontext()
