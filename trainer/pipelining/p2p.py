"""Pipeline point-to-point transfers between neighbouring stages.

Every transfer is one batched isend/irecv through the comm layer (traced as send_forward, recv_forward,
send_backward, recv_backward on the "pp" group). Sends and receives are separate operations (MegaScale
3.2): a send is issued asynchronously and only waited on at the end of the step, so it never delays the
receive or the compute that follows; a receive is posted ahead of time and waited on right before its
data is used.

Neighbours wrap around (stage pp-1 -> stage 0) because the interleaved schedule passes chunk c of the
last stage to chunk c+1 of the first. Each message carries a tag unique to (consumer virtual stage,
micro-batch, direction): gloo matches sends to receives by (peer, tag), so the activation and gradient
streams between the same two ranks (pp = 2 with vpp > 1) can never be confused. NCCL ignores tags and
matches in issue order; every stream here is issued in the same (schedule) order on both sides.

Scatter/gather (Megatron SC21 4.1): without sequence parallelism, the hidden state at a stage boundary
is replicated on every tensor-parallel rank. With `scatter_gather` each tp rank sends only its 1/tp
slice and the receivers all-gather the slices over tp (fast intra-node links), cutting the bytes
between stages by tp. Under sequence parallelism each tp rank already holds a different 1/tp of the
sequence, so it sends exactly that and there is nothing left to scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megascope.tracer import comm
from megascope.trainer.parallel.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from megascope.trainer.robust.faults import Faults

FORWARD, BACKWARD = "forward", "backward"


@dataclass
class PendingRecv:
    """A posted receive; `PipeComm.wait(pending)` returns the full tensor."""

    works: list
    buffer: torch.Tensor


class PipeComm:
    """Sends and receives of one rank's stage boundary tensors ([micro_batch, s_local, h])."""

    def __init__(self, dims: ParallelDims, rank: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, scatter_gather: bool, faults: Faults | None = None) -> None:
        c = dims.coords(rank)
        self.group = dims.groups["pp"]
        self.tp_group = dims.groups["tp"]
        self.tp, self.tp_rank = dims.tp, c.tp
        self.next_rank = dims.rank_of((c.pp + 1) % dims.pp, c.dp, c.tp)
        self.prev_rank = dims.rank_of((c.pp - 1) % dims.pp, c.dp, c.tp)
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.numel = int(torch.Size(shape).numel())
        self.scatter_gather = scatter_gather and dims.tp > 1 and self.numel % dims.tp == 0
        self.faults = faults
        self._in_flight: list[tuple[list, torch.Tensor]] = []
        self.bytes_sent = 0
        """Bytes this rank handed to pipeline sends (the measure of the scatter/gather saving)."""

    def _wire_numel(self) -> int:
        return self.numel // self.tp if self.scatter_gather else self.numel

    def send(self, tensor: torch.Tensor, direction: str, tag: int) -> None:
        """Asynchronously send `tensor` to the next stage (forward) or the previous one (backward)."""
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"pipeline send of shape {tuple(tensor.shape)}, expected {self.shape}: every "
                             "micro-batch must have micro_batch x s_local x hidden elements")
        peer = self.next_rank if direction == FORWARD else self.prev_rank
        payload = tensor.detach().to(self.dtype).reshape(-1)
        if self.scatter_gather:
            part = self._wire_numel()
            payload = payload[self.tp_rank * part:(self.tp_rank + 1) * part]
        payload = payload.contiguous()
        self._before_transfer(peer)
        op = dist.P2POp(dist.isend, payload, peer, self.group, tag)
        works = comm.batch_isend_irecv([op], group_name="pp", names=[f"send_{direction}"])
        self._in_flight.append((works, payload))  # the payload must outlive the transfer
        self.bytes_sent += payload.numel() * payload.element_size()
        self._forget_completed()

    def post_recv(self, direction: str, tag: int) -> PendingRecv:
        """Post a receive of an activation (forward, from the previous stage) or of a gradient
        (backward, from the next stage); returns at once."""
        peer = self.prev_rank if direction == FORWARD else self.next_rank
        buffer = torch.empty(self._wire_numel(), dtype=self.dtype, device=self.device)
        self._before_transfer(peer)
        op = dist.P2POp(dist.irecv, buffer, peer, self.group, tag)
        works = comm.batch_isend_irecv([op], group_name="pp", names=[f"recv_{direction}"])
        return PendingRecv(works, buffer)

    def wait(self, pending: PendingRecv) -> torch.Tensor:
        """Block until the receive landed; all-gather the tp slices under scatter/gather."""
        for work in pending.works:
            work.wait()
        if not self.scatter_gather:
            return pending.buffer.view(self.shape)
        full = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        comm.all_gather_into_tensor(full, pending.buffer, self.tp_group, "tp", name="pp_gather")
        return full.view(self.shape)

    def finish(self) -> None:
        """Wait for every send still in flight (end of step)."""
        for works, _ in self._in_flight:
            for work in works:
                work.wait()
        self._in_flight.clear()

    def _forget_completed(self) -> None:
        still = []
        for works, payload in self._in_flight:
            if not all(_completed(w) for w in works):
                still.append((works, payload))
        self._in_flight = still

    def _before_transfer(self, peer: int) -> None:
        if self.faults is not None:
            self.faults.before_p2p([peer])


def _completed(work: object) -> bool:
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if is_completed is not None else False


def message_tag(consumer_virtual_stage: int, microbatch: int, n_micro: int, direction: str) -> int:
    """A tag unique to one boundary tensor of one step (see the module docstring)."""
    return (consumer_virtual_stage * n_micro + microbatch) * 2 + (0 if direction == FORWARD else 1)
