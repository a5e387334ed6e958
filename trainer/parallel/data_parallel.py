"""Data parallelism: the distributed optimizer (ZeRO-2, Megatron-style) and the plain all-reduce option.

ZeRO-2 (`zero=True`), per step:
  backward   each gradient bucket, once all its grads are in (last micro-batch only), is divided by dp
             and reduce-scattered in place, asynchronously, while backward goes on (MegaScale 3.2);
  step       rank d owns shard d of every bucket: fp32 master weights and optimizer state for that
             shard only; global-norm clipping; AdamW or LAMB on the shard;
  all-gather the updated shards go back into the model's parameters bucket by bucket; the bucket(s)
             the next forward needs first are left in flight and waited on by forward pre-hooks of
             the modules that use them, so they overlap data loading and the next step's start.
Plain (`zero=False`): buckets are all-reduced instead, and every rank updates every parameter.

Call order per step (the trainer's):

    opt.zero_grad()
    for each micro-batch:  opt.set_sync(is_last_microbatch); forward; backward
    opt.finish_grad_sync()          # (or per chunk: finish_grad_sync(chunk=i))
    sync_tp_grads(...)              # tensor parallel; after the dp reduction (layouts match across tp)
    grad_norm = opt.step(lr)
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megascope.tracer import comm
from megascope.trainer.config import ParallelConfig, TrainConfig
from megascope.trainer.optimizers import AdamW, ShardLayout, build_optimizer
from megascope.trainer.parallel.grad_buckets import Bucket, ChunkBuffers
from megascope.trainer.parallel.parallel_dims import ParallelDims

MiB = 1 << 20
PREFETCH_BUCKETS = 1
"""Buckets per chunk (in forward order) whose all-gather is left in flight after step()."""


NORM_PIECE = 1 << 26
"""Elements per piece of the gradient-norm reduction."""


class DistributedOptimizer:
    """Owns the gradient buffers, the (sharded) optimizer and the dp communication of model chunks."""

    def __init__(self, chunks: Sequence[nn.Module], dims: ParallelDims, parallel_cfg: ParallelConfig,
                 train_cfg: TrainConfig, before_dp_collective: Callable[[], None] | None = None) -> None:
        if not chunks:
            raise ValueError("DistributedOptimizer needs at least one model chunk")
        self.dims = dims
        self.zero = parallel_cfg.zero
        self.train_cfg = train_cfg
        self.before_dp_collective = before_dp_collective
        self.dp_group = dims.groups["dp"]
        self.dp_rank = dims.coords(dist.get_rank()).dp if dims.dp > 1 else 0
        self.chunks: list[ChunkBuffers] = []
        for i, module in enumerate(chunks):
            first = sum(len(c.slots) for c in self.chunks)
            self.chunks.append(ChunkBuffers(i, module, dims.dp, parallel_cfg.bucket_mb * MiB, first))
        self._slots = {id(s.param): s for c in self.chunks for s in c.slots}
        self._master_ranges: list[tuple[Bucket, int, int]] = []  # bucket -> [lo, hi) in self.master
        layout = self._build_shard_layout()
        self._master_index = {b: (lo, hi) for b, lo, hi in self._master_ranges}
        # The fp32 master shard and the gradient shard the optimizer reads are the chunk's own buffers
        # when the rank holds all of one fp32 chunk (no ZeRO, or dp = 1): two copies of the model
        # fewer (16 GB at 2B parameters) and no per-step copy in or out. Otherwise they are copies.
        only = self.chunks[0]
        self._aliased = (len(self.chunks) == 1 and (not self.zero or dims.dp == 1)
                         and only.param_buffer.dtype == torch.float32)
        if self._aliased:
            self.master, self._grad_shard = only.param_buffer, only.grad_buffer
        else:
            self.master = torch.cat([self._held(b, b.data).float() for b, _, _ in self._master_ranges])
            self._grad_shard = torch.empty_like(self.master)
        self.optimizer: AdamW = build_optimizer(
            train_cfg.optimizer, layout, (train_cfg.beta1, train_cfg.beta2), train_cfg.weight_decay,
            dp_group=self.dp_group if self.zero and dims.dp > 1 else None,
            tp_group=dims.groups.get("tp") if dims.tp > 1 else None,
            before_dp_collective=before_dp_collective, device=self.master.device)
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_grad_ready) for s in self._slots.values()]
        self._hooks += self._register_prefetch_waits()

    # ---------------------------------------------------------------- layout

    def _held(self, bucket: Bucket, buffer: torch.Tensor) -> torch.Tensor:
        """The part of a bucket's buffer this rank optimizes: its shard (ZeRO) or all of it."""
        return bucket.shard(buffer, self.dp_rank) if self.zero else buffer

    def _build_shard_layout(self) -> ShardLayout:
        n_params = len(self._slots)
        ids, decay, norm = [], [], []
        offset = 0
        for chunk in self.chunks:
            seg = torch.full((chunk.numel,), n_params, dtype=torch.int32)
            dec = torch.zeros(chunk.numel)
            own = torch.zeros(chunk.numel, dtype=torch.bool)
            for s in chunk.slots:
                sl = slice(s.offset, s.offset + s.numel)
                seg[sl] = s.index
                dec[sl] = float(s.param.dim() >= 2)
                own[sl] = getattr(s.param, "norm_owner", True) is not False
            for b in chunk.buckets:
                held = self._held(b, torch.arange(b.start, b.end))
                ids.append(seg[held])
                decay.append(dec[held])
                # the norm counts each element once across dp: only this rank's shard region, even
                # when (plain mode) the rank holds the whole bucket
                in_shard = torch.zeros(b.numel, dtype=torch.bool)
                b.shard(in_shard, self.dp_rank).fill_(True)
                norm.append(own[held] & self._held(b, in_shard))
                self._master_ranges.append((b, offset, offset + held.numel()))
                offset += held.numel()
        sharded = torch.tensor([getattr(s.param, "tp_sharded", False) is True
                                for c in self.chunks for s in c.slots], dtype=torch.bool)
        device = self.chunks[0].device
        self._norm_mask = torch.cat(norm).to(device)
        # The layout stays on the CPU: AdamW needs only its decay runs, LAMB moves it to the device.
        return ShardLayout(torch.cat(ids), n_params, torch.cat(decay), sharded)

    # ---------------------------------------------------------------- backward side

    def zero_grad(self) -> None:
        """Zero the gradient buffers and re-arm the buckets for the next step (never set grads to None
        yourself: .grad must stay a view of the buffer)."""
        for chunk in self.chunks:
            for b in chunk.buckets:
                b.wait_grad()
            chunk.rebind_grads()

    def set_sync(self, is_last_microbatch: bool, chunk: int | None = None) -> None:
        """Only the last micro-batch's backward launches dp communication; earlier ones accumulate."""
        for c in self._select(chunk):
            c.sync_enabled = is_last_microbatch

    @contextlib.contextmanager
    def no_sync(self, chunk: int | None = None) -> Iterator[None]:
        """`with opt.no_sync(): backward()` accumulates without communicating."""
        previous = [c.sync_enabled for c in self._select(chunk)]
        self.set_sync(False, chunk)
        try:
            yield
        finally:
            for c, flag in zip(self._select(chunk), previous):
                c.sync_enabled = flag

    def _select(self, chunk: int | None) -> list[ChunkBuffers]:
        return self.chunks if chunk is None else [self.chunks[chunk]]

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        slot = self._slots[id(param)]
        if slot.copy_grad:
            getattr(param, "main_grad").add_(param.grad)  # the view grad_buckets attached
            param.grad = None
        bucket = slot.bucket
        assert bucket is not None  # ChunkBuffers binds every slot to its bucket
        chunk = self.chunks[bucket.chunk]
        if not chunk.sync_enabled:
            return
        if bucket.launched:
            raise RuntimeError(
                "a gradient arrived for a bucket whose dp reduction was already launched this step; "
                "call opt.set_sync(False) before every micro-batch but the last, and opt.zero_grad() "
                "at the start of each step")
        bucket.pending.discard(id(param))
        self._launch_ready(chunk)

    def _launch_ready(self, chunk: ChunkBuffers, force: bool = False) -> None:
        # strictly in bucket order, so every dp rank issues the same collectives in the same order
        while chunk.next_to_launch < len(chunk.buckets):
            bucket = chunk.buckets[chunk.next_to_launch]
            if bucket.pending and not force:
                return
            self._launch_grad_reduction(bucket)
            chunk.next_to_launch += 1

    def _launch_grad_reduction(self, bucket: Bucket) -> None:
        bucket.launched = True
        bucket.pending.clear()
        if self.dims.dp == 1:
            return
        bucket.grad.div_(self.dims.dp)  # average over dp (gloo has no AVG op); exact for powers of 2
        if self.before_dp_collective is not None:
            self.before_dp_collective()
        if self.zero:  # in place: the output is this rank's slice of the input, as NCCL allows
            bucket.grad_work = comm.reduce_scatter_tensor(
                bucket.shard(bucket.grad, self.dp_rank), bucket.grad, self.dp_group, "dp",
                async_op=True, name="grad_reduce_scatter")
        else:
            bucket.grad_work = comm.all_reduce(bucket.grad, self.dp_group, "dp", async_op=True,
                                               name="grad_all_reduce")

    def finish_grad_sync(self, chunk: int | None = None) -> None:
        """Launch whatever backward did not (params without grads, or sync never enabled) and wait for
        every outstanding reduction of the chunk(s). After this, this rank's shard of each bucket
        (ZeRO) or the whole buffer (plain) holds dp-averaged gradients."""
        for c in self._select(chunk):
            self._launch_ready(c, force=True)
            for b in c.buckets:
                b.wait_grad()

    # ---------------------------------------------------------------- step and all-gather

    def step(self, lr: float) -> float:
        """Clip by the global gradient norm, update this rank's shard, start the all-gathers.
        Returns the norm before clipping."""
        self.finish_grad_sync()
        self.wait_param_sync()
        if not self._aliased:
            for bucket, lo, hi in self._master_ranges:
                self._grad_shard[lo:hi].copy_(self._held(bucket, bucket.grad))
        grad_norm = self._global_grad_norm()
        clip = self.train_cfg.grad_clip
        if clip > 0 and grad_norm > clip:
            self._grad_shard.mul_(clip / (grad_norm + 1e-6))
        self.optimizer.step(self.master, self._grad_shard, lr)
        self._write_back_params()
        return grad_norm

    def _global_grad_norm(self) -> float:
        """sqrt of the sum of squares over every rank's shard, each element counted once: duplicates
        (norm_owner=False: tp-replicated params on tp ranks > 0, the second tied embedding) are left out."""
        g, mask = self._grad_shard, self._norm_mask
        # in pieces: the temporaries stay at 256 MiB instead of the shard's size (8 GB at 2B parameters)
        pieces = [slice(lo, lo + NORM_PIECE) for lo in range(0, g.numel(), NORM_PIECE)]
        sq = torch.stack([(g[p] * g[p] * mask[p]).sum() for p in pieces]).sum().reshape(1)
        comm.all_reduce(sq, self.dims.groups["world"], "world", name="grad_norm")
        return math.sqrt(sq.item())  # note: this is a CPU-GPU sync point (clipping needs the value)

    def _write_back_params(self) -> None:
        for chunk in self.chunks:
            # forward order = reverse bucket order; the first PREFETCH_BUCKETS of it go last and stay
            # in flight, so the gathers issued before them (which we wait on here) don't delay them
            order = list(reversed(chunk.buckets))
            prefetched, rest = order[:PREFETCH_BUCKETS], order[PREFETCH_BUCKETS:]
            for bucket in rest + prefetched:
                self._gather_bucket(bucket)
            for bucket in rest:
                bucket.wait_gather()

    def _gather_bucket(self, bucket: Bucket) -> None:
        if self._aliased:
            return  # the optimizer updated the parameters in place
        lo, hi = self._master_index[bucket]
        new_values = self.master[lo:hi].to(bucket.data.dtype)
        if not self.zero or self.dims.dp == 1:
            self._held(bucket, bucket.data).copy_(new_values)
            return
        if self.before_dp_collective is not None:
            self.before_dp_collective()
        bucket.gather_work = comm.all_gather_into_tensor(bucket.data, new_values, self.dp_group, "dp",
                                                         async_op=True, name="param_all_gather")

    def wait_param_sync(self, chunk: int | None = None) -> None:
        """Wait for the all-gathers still in flight. Forward pre-hooks do this just in time; call it
        before reading parameters outside a forward (checkpointing, evaluation, tests)."""
        for c in self._select(chunk):
            for b in c.buckets:
                b.wait_gather()

    @property
    def params_in_flight(self) -> int:
        """Buckets whose parameter all-gather has been issued but not waited on."""
        return sum(b.gather_work is not None for c in self.chunks for b in c.buckets)

    def _register_prefetch_waits(self) -> list:
        """A forward pre-hook on every module that contains a prefetched parameter: it waits for that
        parameter's all-gather. Subtree, not just direct params, because a parent may use a child's
        weight without calling the child (e.g. F.linear(x, fc1.weight))."""
        handles = []
        for chunk in self.chunks:
            prefetched = set(chunk.buckets[-PREFETCH_BUCKETS:])
            for module in chunk.module.modules():
                needed = {self._slots[id(p)].bucket for p in module.parameters() if id(p) in self._slots}
                waits = [b for b in prefetched if b in needed]
                if waits:
                    handles.append(module.register_forward_pre_hook(_waiter(waits)))
        return handles

    # ---------------------------------------------------------------- checkpointing

    def state_dict(self) -> dict:
        """This rank's shard: master weights and optimizer state (save one file per rank)."""
        return {"zero": self.zero, "dp_rank": self.dp_rank, "master": self.master,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["master"].shape != self.master.shape:
            raise ValueError(f"optimizer shard has {state['master'].numel()} elements, this rank holds "
                             f"{self.master.numel()}; resume with the same dp/tp/pp/bucket_mb layout")
        self.master.copy_(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.wait_param_sync()
        for chunk in self.chunks:
            for bucket in chunk.buckets:
                self._gather_bucket(bucket)
        self.wait_param_sync()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _waiter(buckets: list[Bucket]) -> Callable:
    def wait_for_params(module: nn.Module, args: tuple) -> None:
        for b in buckets:
            if b.gather_work is not None:
                b.wait_gather()
    return wait_for_params

