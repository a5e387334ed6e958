"""Pipeline schedules as pure action lists, and the executor that runs one on a stage.

A schedule is the ordered list of (forward | backward, chunk, micro-batch) a stage computes in one
step; communication follows from it (a chunk's forward needs the previous virtual stage's activation,
its backward the next virtual stage's gradient), so the list alone fixes the pipeline's behaviour and
its bubble, and can be checked without any process group.

- pp = 1: forward then backward per micro-batch, gradients accumulating (the degenerate schedule).
- 1F1B (PipeDream-Flush): stage p runs pp-p-1 warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Bubble (p-1)/m of the ideal time.
- Interleaved 1F1B (Megatron-LM SC21): each stage holds vpp chunks and cycles through them in groups
  of pp micro-batches; bubble (p-1)/(v*m). Needs m divisible by pp.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from megascope import tracer as tracing
from megascope.trainer.p2p import message_tag

if TYPE_CHECKING:
    from megascope.trainer.p2p import PipeComm

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str
    """F (forward) or B (backward)."""
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


def schedule_name(pp: int, vpp: int) -> str:
    return "none" if pp == 1 else ("interleaved" if vpp > 1 else "1f1b")


def analytical_bubble(pp: int, vpp: int, n_micro: int) -> float:
    """Bubble time as a fraction of the ideal (bubble-free) time: (p-1)/(v*m)."""
    return (pp - 1) / (vpp * n_micro)


def one_f_one_b(pp: int, stage: int, n_micro: int) -> list[Action]:
    """PipeDream-Flush for one stage (also pp = 1: F, B per micro-batch)."""
    warmup = min(pp - stage - 1, n_micro)
    actions = [Action(FORWARD, 0, mb) for mb in range(warmup)]
    for i in range(n_micro - warmup):
        actions.append(Action(FORWARD, 0, warmup + i))
        actions.append(Action(BACKWARD, 0, i))
    actions += [Action(BACKWARD, 0, mb) for mb in range(n_micro - warmup, n_micro)]
    return actions


def interleaved_one_f_one_b(pp: int, vpp: int, stage: int, n_micro: int) -> list[Action]:
    """Megatron-LM's interleaved schedule for one stage. The k-th forward of a stage runs chunk
    (k mod pp*vpp) // pp on micro-batch (k // (pp*vpp))*pp + k mod pp; backwards visit chunks in
    reverse. Warm-up: (pp - stage - 1)*2 + (vpp - 1)*pp forwards (all of them when m == pp)."""
    if n_micro % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({n_micro}) divisible by pp={pp}; "
                         "change --global-batch or --micro-batch")
    total = n_micro * vpp
    group = pp * vpp

    def at(k: int, kind: str) -> Action:
        chunk = (k % group) // pp
        if kind == BACKWARD:
            chunk = vpp - 1 - chunk
        return Action(kind, chunk, (k // group) * pp + k % pp)

    warmup = total if n_micro == pp else min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    actions = [at(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        actions.append(at(warmup + k, FORWARD))
        actions.append(at(k, BACKWARD))
    actions += [at(k, BACKWARD) for k in range(total - warmup, total)]
    return actions


def build_schedule(pp: int, vpp: int, stage: int, n_micro: int) -> list[Action]:
    """The schedule `ParallelConfig` selects: interleaved when vpp > 1, else 1F1B (pp = 1 included)."""
    if vpp > 1:
        return interleaved_one_f_one_b(pp, vpp, stage, n_micro)
    return one_f_one_b(pp, stage, n_micro)


def simulate(pp: int, vpp: int, n_micro: int, forward_time: float = 1.0,
             backward_time: float = 2.0) -> float:
    """Makespan of the whole pipeline when every chunk's forward/backward takes the given times and
    transfers are free: a dependency-driven replay of build_schedule on every stage. Checks that the
    schedules are deadlock-free and gives the bubble a schedule really has (tests, benchmark)."""
    n_virtual = pp * vpp
    queues = [build_schedule(pp, vpp, s, n_micro) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> finish time
    clock = [0.0] * pp
    pos = [0] * pp
    scale = 1.0 / vpp  # a chunk holds 1/vpp of a stage's layers
    while any(pos[s] < len(queues[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if pos[s] == len(queues[s]):
                continue
            a = queues[s][pos[s]]
            vs = a.chunk * pp + s
            if a.kind == FORWARD:
                dep = ("F", vs - 1, a.microbatch) if vs > 0 else None
            else:
                dep = ("B", vs + 1, a.microbatch) if vs < n_virtual - 1 else ("F", vs, a.microbatch)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep] if dep else 0.0)
            cost = (forward_time if a.kind == FORWARD else backward_time) * scale
            clock[s] = start + cost
            done[(a.kind, vs, a.microbatch)] = clock[s]
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks for pp={pp}, vpp={vpp}, m={n_micro}")
    return max(clock)


# ---------------------------------------------------------------------------------------- executor


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
                 faults: object | None = None, autocast: Callable[[], ContextManager] | None = None,
                 device_sync: Callable[[], None] | None = None) -> None:
        self.chunks, self.pipe, self.pp, self.stage, self.n_micro = chunks, pipe, pp, stage, n_micro
        self.set_grad_sync = set_grad_sync
        self.faults = faults
        self.autocast = autocast or contextlib.nullcontext
        self.device_sync = device_sync
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
            x = tokens[a.microbatch]
        else:
            x = self.pipe.wait(pending).requires_grad_()
        with _compute_span("forward"), self._stretch(), self.autocast():
            out = chunk(x)
            if p.is_last:
                # 1/m: the accumulated gradient is the mean over micro-batches, as in one big batch
                out = chunk.loss(out, targets[a.microbatch]) / self.n_micro
        self._saved[(a.chunk, a.microbatch)] = (x, out)
        if p.is_last:
            loss = out.detach()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        else:
            self.pipe.send(out, "forward", message_tag(p.virtual_stage + 1, a.microbatch, self.n_micro, "forward"))

    def _backward(self, a: Action, pending) -> None:
        p = self._placement(a.chunk)
        x, out = self._saved.pop((a.chunk, a.microbatch))
        grad = None if p.is_last else self.pipe.wait(pending)
        if self.set_grad_sync is not None:  # the data-parallel reduction runs on a chunk's last micro-batch
            self.set_grad_sync(a.chunk, a.microbatch == self.n_micro - 1)
        with _compute_span("backward"), self._stretch():
            torch.autograd.backward(out, grad_tensors=grad)
        if not p.is_first:
            self.pipe.send(x.grad, "backward", message_tag(p.virtual_stage - 1, a.microbatch, self.n_micro, "backward"))

    def _stretch(self) -> ContextManager:
        if self.faults is None:
            return contextlib.nullcontext()
        return self.faults.compute(self.device_sync)


def _set_microbatch(microbatch: int, chunk: int) -> None:
    setter = getattr(tracing, "set_microbatch", None)  # no-op until/unless the tracer provides it
    if setter is not None:
        setter(microbatch, chunk)


def _compute_span(name: str) -> ContextManager:
    span = getattr(tracing, "span", None)
    return span(name, kind="compute") if span is not None else contextlib.nullcontext()
