"""Flat parameter and gradient buffers of one model chunk, cut into communication buckets.

Parameters are laid out in reverse registration order (roughly the order backward produces their
gradients), so the first bucket fills first and its reduction overlaps the rest of backward. Each
bucket is padded to a multiple of dp so it splits into dp equal shards; rank d owns shard d of every
bucket. Every parameter's `.data` becomes a view of the chunk's parameter buffer (so an all-gather
writes straight into the model) and its `.grad` and `.main_grad` views of the fp32 gradient buffer
(so autograd accumulates micro-batches in place and a collective reads them without a copy).

A parameter marked `shared_embedding=True` (the tied embedding duplicated on the first and last
pipeline stage) gets a bucket of its own, so both copies are sharded the same way across dp and the
pipeline's all-reduce of their gradients can run after the dp reduce-scatter (Megatron does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

FP32_BYTES = 4


class Waitable(Protocol):
    """What an async collective hands back: a torch.distributed Work, or the tracer's wrapper of one."""

    def wait(self) -> Any: ...


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives in its chunk's flat buffers."""

    param: nn.Parameter
    index: int
    """Optimizer-wide parameter number (the same on every dp/tp rank)."""
    offset: int
    """First element in the chunk's flat buffers."""
    bucket: "Bucket | None" = None
    copy_grad: bool = False
    """The param is not fp32, so autograd writes .grad elsewhere and the hook adds it to main_grad."""

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass(eq=False)
class Bucket:
    """A contiguous run of a chunk's buffers that is reduced (and gathered) as one collective."""

    chunk: int
    index: int
    """Position in backward order within the chunk (0 = reduced first)."""
    start: int
    end: int
    """[start, end) in the chunk's flat buffers; end - start is divisible by dp."""
    dp: int
    slots: list[ParamSlot]
    grad: torch.Tensor
    data: torch.Tensor
    # per-step state
    pending: set[int] = field(default_factory=set)
    launched: bool = False
    grad_work: Waitable | None = None
    gather_work: Waitable | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.dp

    def shard(self, buffer: torch.Tensor, dp_rank: int) -> torch.Tensor:
        """Rank dp_rank's slice of `buffer` (this bucket's grad or data)."""
        return buffer[dp_rank * self.shard_size:(dp_rank + 1) * self.shard_size]

    def reset(self) -> None:
        self.pending = {id(s.param) for s in self.slots}
        self.launched = False

    def wait_grad(self) -> None:
        if self.grad_work is not None:
            self.grad_work.wait()
            self.grad_work = None

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters in registration order, each once (tied weights appear once)."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def group_into_buckets(params: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Split params (already in backward order) into runs of at least bucket_bytes of fp32 grads;
    a `shared_embedding` param always stands alone."""
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if getattr(p, "shared_embedding", False):
            if current:
                groups.append(current)
            groups.append([p])
            current, size = [], 0
            continue
        current.append(p)
        size += p.numel() * FP32_BYTES
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


class ChunkBuffers:
    """The flat buffers and buckets of one model chunk (a pipeline virtual chunk, or the whole model)."""

    def __init__(self, chunk: int, module: nn.Module, dp: int, bucket_bytes: float, first_index: int) -> None:
        self.chunk = chunk
        self.module = module
        params = list(reversed(trainable_params(module)))
        if not params:
            raise ValueError(f"model chunk {chunk} has no trainable parameters")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"model chunk {chunk} mixes dtypes {dtypes} or devices {devices}; "
                             "cast/move the whole chunk before building the optimizer")
        self.device = params[0].device
        self.slots: list[ParamSlot] = []
        layout: list[tuple[int, int, list[ParamSlot]]] = []
        pos = 0
        for group in group_into_buckets(params, bucket_bytes):
            start = pos
            slots: list[ParamSlot] = []
            for p in group:
                slots.append(ParamSlot(p, first_index + len(self.slots) + len(slots), pos))
                pos += p.numel()
            pos = start + -(-(pos - start) // dp) * dp  # pad to a multiple of dp
            layout.append((start, pos, slots))
            self.slots.extend(slots)
        self.grad_buffer = torch.zeros(pos, dtype=torch.float32, device=self.device)
        self.param_buffer = torch.zeros(pos, dtype=params[0].dtype, device=self.device)
        self.buckets = [Bucket(chunk, i, start, end, dp, slots, self.grad_buffer[start:end],
                               self.param_buffer[start:end])
                        for i, (start, end, slots) in enumerate(layout)]
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.bucket = bucket
                self._bind(slot)
            bucket.reset()
        self.next_to_launch = 0
        self.sync_enabled = True

    def _bind(self, slot: ParamSlot) -> None:
        p, n = slot.param, slot.numel
        data = self.param_buffer[slot.offset:slot.offset + n].view_as(p)
        data.copy_(p.data)
        p.data = data
        main_grad = self.grad_buffer[slot.offset:slot.offset + n].view_as(p)
        setattr(p, "main_grad", main_grad)  # a Parameter attribute, as Megatron's (torch declares none)
        slot.copy_grad = p.dtype != torch.float32
        # fp32 params: autograd adds into an existing .grad in place, so .grad IS the buffer view
        p.grad = None if slot.copy_grad else main_grad

    def rebind_grads(self) -> None:
        """Point .grad back at the buffer (after someone set it to None) and zero the buffer."""
        self.grad_buffer.zero_()
        for slot in self.slots:
            if not slot.copy_grad:
                main_grad = getattr(slot.param, "main_grad")
                if slot.param.grad is not main_grad:
                    slot.param.grad = main_grad
        for bucket in self.buckets:
            bucket.reset()
        self.next_to_launch = 0

    @property
    def numel(self) -> int:
        return self.grad_buffer.numel()
