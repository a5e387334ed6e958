"""AdamW and LAMB on flat fp32 shards.

The distributed optimizer hands each rank one flat fp32 tensor: its 1/dp slice of every gradient
bucket, concatenated (or, without ZeRO, the whole buffer). Parameters are cut at arbitrary points by
that slicing, so anything per-parameter (weight-decay exemption, LAMB's per-layer trust ratio) is
described by a `ShardLayout`: for every element of the shard, which parameter it belongs to.

LAMB needs the norm of each FULL parameter while a rank holds only pieces of it: it sums squares per
parameter segment locally, all-reduces that one small vector over dp, and over tp for parameters that
tensor parallelism splits (`tp_sharded=True`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from megascope.tracer import comm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

ADAMW_EPS = 1e-8  # torch.optim.AdamW's default
LAMB_EPS = 1e-6   # You et al. 2019 / NVIDIA apex FusedLAMB default


@dataclass
class ShardLayout:
    """What each element of a flat shard is. Padding elements belong to segment `n_params`."""

    segment_ids: torch.Tensor
    """int32 [numel]: index of the parameter an element belongs to (n_params for padding)."""
    n_params: int
    """Number of parameters the optimizer manages (same numbering on every dp and tp rank)."""
    decay_mask: torch.Tensor
    """fp32 [numel]: 1 where weight decay applies (params with ndim >= 2), else 0."""
    tp_sharded: torch.Tensor
    """bool [n_params]: the parameter is split across tensor-parallel ranks."""

    @property
    def numel(self) -> int:
        return self.segment_ids.numel()

    @classmethod
    def for_tensors(cls, params: list[torch.Tensor], tp_sharded: list[bool] | None = None) -> "ShardLayout":
        """Layout of the plain concatenation of `params` (no sharding, no padding); used by tests and
        by anyone optimizing a handful of tensors flattened into one."""
        ids = torch.cat([torch.full((p.numel(),), i, dtype=torch.int32) for i, p in enumerate(params)])
        decay = torch.cat([torch.full((p.numel(),), float(p.dim() >= 2)) for p in params])
        sharded = torch.tensor(tp_sharded if tp_sharded is not None else [False] * len(params))
        return cls(ids, len(params), decay, sharded)

    def decay_ranges(self) -> list[tuple[int, int]]:
        """[lo, hi) runs of elements that take weight decay (each is part of one weight matrix)."""
        edges = torch.diff(self.decay_mask.to(device="cpu", dtype=torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                           append=torch.zeros(1, dtype=torch.int8))
        starts = (edges == 1).nonzero().flatten().tolist()
        ends = (edges == -1).nonzero().flatten().tolist()
        return list(zip(starts, ends))

    def to(self, device: torch.device) -> "ShardLayout":
        return ShardLayout(self.segment_ids.to(device), self.n_params, self.decay_mask.to(device),
                           self.tp_sharded.to(device))


class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter) on one flat shard, through the kernel of
    torch.optim.AdamW(fused=True): one pass over the shard per step, no temporaries (the unfused
    arithmetic took 88.6 ms a step for a 2B-parameter shard on an H100, 8.6% of the step). Weight decay
    applies to the weight matrices' runs of the shard: two calls, one per decay setting, over views.
    The state lives on `device` (default: the layout's); the layout itself may stay on the CPU."""

    def __init__(self, layout: ShardLayout, betas: tuple[float, float], weight_decay: float,
                 eps: float = ADAMW_EPS, device: torch.device | None = None) -> None:
        self.layout = layout
        self.beta1, self.beta2 = betas
        self.weight_decay = weight_decay
        self.eps = eps
        self.step_count = 0
        device = device if device is not None else layout.segment_ids.device
        decay = layout.decay_ranges()
        self._groups = [(decay, weight_decay), (_complement(decay, layout.numel), 0.0)]
        self.exp_avg = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self._step = torch.zeros((), dtype=torch.float32, device=device)  # the fused kernel reads it

    def step(self, params: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        self.step_count += 1
        self._step.fill_(self.step_count)
        for ranges, weight_decay in self._groups:
            if not ranges:
                continue
            p, g, m, v = ([t[lo:hi] for lo, hi in ranges] for t in (params, grads, self.exp_avg, self.exp_avg_sq))
            torch._fused_adamw_(p, g, m, v, [], [self._step] * len(ranges), lr=lr, beta1=self.beta1,
                                beta2=self.beta2, weight_decay=weight_decay, eps=self.eps, amsgrad=False,
                                maximize=False)

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


def _complement(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The [lo, hi) runs of [0, numel) that `ranges` (sorted, disjoint) leave out."""
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo))
        at = hi
    if at < numel:
        out.append((at, numel))
    return out


class Lamb(AdamW):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), bias-corrected:

        u = m_hat / (sqrt(v_hat) + eps) + wd * w
        w -= lr * (||w|| / ||u||) * u          per parameter tensor

    with the trust ratio set to 1 where either norm is 0, and (as NVIDIA apex's FusedLAMB does by
    default) only for parameters that take weight decay: biases and norms get plain Adam steps.
    Norms are of full parameters: partial sums are all-reduced over `dp_group` (when the shard is a
    ZeRO slice) and over `tp_group` for tensor-parallel-split parameters.
    """

    def __init__(self, layout: ShardLayout, betas: tuple[float, float], weight_decay: float,
                 eps: float = LAMB_EPS, dp_group: ProcessGroup | None = None, tp_group: ProcessGroup | None = None,
                 before_dp_collective: Callable[[], None] | None = None, device: torch.device | None = None) -> None:
        super().__init__(layout, betas, weight_decay, eps, device)
        self.layout = layout.to(self.exp_avg.device)  # LAMB reads every element's parameter
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.before_dp_collective = before_dp_collective
        self._any_tp_sharded = bool(layout.tp_sharded.any())  # once, not a per-step device sync

    def step(self, params: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        self.step_count += 1
        bc1 = 1 - self.beta1 ** self.step_count
        bc2 = 1 - self.beta2 ** self.step_count
        self.exp_avg.lerp_(grads, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grads, grads, value=1 - self.beta2)
        update = (self.exp_avg / bc1) / ((self.exp_avg_sq / bc2).sqrt_().add_(self.eps))
        update.add_(params * self.layout.decay_mask, alpha=self.weight_decay)
        w_norm, u_norm = self._full_param_norms(params, update)
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        ratio = torch.cat([ratio, ratio.new_ones(1)])  # padding segment
        per_element = ratio[self.layout.segment_ids]
        per_element = torch.where(self.layout.decay_mask > 0, per_element, torch.ones_like(per_element))
        params.addcmul_(per_element, update, value=-lr)

    def _full_param_norms(self, params: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-parameter ||w|| and ||u|| over the full tensors, from this shard's partial sums."""
        n = self.layout.n_params
        sums = params.new_zeros(2, n + 1)
        sums[0].index_add_(0, self.layout.segment_ids, params * params)
        sums[1].index_add_(0, self.layout.segment_ids, update * update)
        sums = sums[:, :n].contiguous()
        if self.dp_group is not None:
            if self.before_dp_collective is not None:
                self.before_dp_collective()
            comm.all_reduce(sums, self.dp_group, "dp", name="lamb_norms")
        if self.tp_group is not None and self._any_tp_sharded:
            split = sums * self.layout.tp_sharded  # replicated params are whole on every tp rank
            comm.all_reduce(split, self.tp_group, "tp", name="lamb_norms")
            sums = torch.where(self.layout.tp_sharded, split, sums)
        norms = sums.sqrt()
        return norms[0], norms[1]


def build_optimizer(name: str, layout: ShardLayout, betas: tuple[float, float], weight_decay: float,
                    dp_group: ProcessGroup | None = None, tp_group: ProcessGroup | None = None,
                    before_dp_collective: Callable[[], None] | None = None,
                    device: torch.device | None = None) -> AdamW:
    """`name` is TrainConfig.optimizer: adamw or lamb. dp_group: set when the shard is a ZeRO slice.
    The state goes to `device` (default: the layout's)."""
    if name == "adamw":
        return AdamW(layout, betas, weight_decay, device=device)
    if name == "lamb":
        return Lamb(layout, betas, weight_decay, dp_group=dp_group, tp_group=tp_group,
                    before_dp_collective=before_dp_collective, device=device)
    raise ValueError(f"optimizer '{name}' unknown; use adamw or lamb")
