"""The distributed optimizer on real gloo groups: ZeRO-2 and plain all-reduce against one process."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megascope.samples.distributed import run_distributed
from megascope.tracer import comm
from megascope.trainer.config import ModelConfig, ParallelConfig, TrainConfig
from megascope.trainer.parallel.data_parallel import DistributedOptimizer
from megascope.trainer.parallel.parallel_dims import ParallelDims

GLOBAL_BATCH = 8
MICRO_BATCH = 2
STEPS = 3
LR = 1e-2
CLIP = 0.5          # small enough that clipping kicks in on some steps
TINY_BUCKET_MB = 240 / (1 << 20)  # ~60 floats: several buckets for the MLP below, odd sizes padded


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 3))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def train_cfg(optimizer: str) -> TrainConfig:
    return TrainConfig(optimizer=optimizer, lr=LR, weight_decay=0.1, grad_clip=CLIP)


def gathered_grads(opt: DistributedOptimizer, model: nn.Module) -> list[list[float]]:
    """Full dp-averaged gradients per parameter: in ZeRO mode each rank holds only its shard of each
    bucket, so gather the shards (test-only, straight through torch.distributed)."""
    full = []
    for chunk in opt.chunks:
        buffer = chunk.grad_buffer.clone()
        if opt.zero and opt.dims.dp > 1:
            for b in chunk.buckets:
                out = torch.empty(b.numel)
                comm.all_gather_into_tensor(out, b.shard(b.grad, opt.dp_rank).clone(), opt.dp_group, "dp")
                buffer[b.start:b.end] = out
        full.append(buffer)
    slots = {id(s.param): (c, s) for c, ch in enumerate(opt.chunks) for s in ch.slots}
    out = []
    for p in model.parameters():
        c, s = slots[id(p)]
        out.append(full[c][s.offset:s.offset + s.numel].tolist())
    return out


def _train_mlp(rank: int, world: int, variants: list[tuple[bool, str]]) -> list[dict]:
    dims = ParallelDims(dp=world, tp=1, pp=1)
    dims.build_groups()
    results = []
    for zero, optimizer in variants:
        model = make_mlp()
        issued: list[int] = []
        opt = DistributedOptimizer([model], dims, ParallelConfig(dp=world, zero=zero, bucket_mb=TINY_BUCKET_MB),
                                   train_cfg(optimizer), before_dp_collective=lambda: issued.append(1))
        per_rank = GLOBAL_BATCH // world
        n_micro = per_rank // MICRO_BATCH
        rec: dict = {"loss": [], "norm": [], "grads": [], "issued_in_backward": [], "in_flight": [],
                     "in_flight_after_forward": []}
        for step in range(STEPS):
            x, y = global_batch(step)
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            opt.zero_grad()
            loss_sum = torch.zeros(1)
            for m in range(n_micro):
                opt.set_sync(m == n_micro - 1)
                before = len(issued)
                sl = slice(m * MICRO_BATCH, (m + 1) * MICRO_BATCH)
                loss = nn.functional.mse_loss(model(x[sl]), y[sl]) / n_micro
                if m == 0:
                    rec["in_flight_after_forward"].append(opt.params_in_flight)
                loss.backward()
                rec["issued_in_backward"].append(len(issued) - before)
                loss_sum += loss.detach()
            opt.finish_grad_sync()
            dist.all_reduce(loss_sum)
            rec["loss"].append(loss_sum.item() / world)
            rec["grads"].append(gathered_grads(opt, model))
            rec["norm"].append(opt.step(LR))
            rec["in_flight"].append(opt.params_in_flight)
        opt.wait_param_sync()
        rec["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
        rec["n_buckets"] = len(opt.chunks[0].buckets)
        rec["n_micro"] = n_micro
        results.append(rec)
    return results


def reference_adamw() -> dict:
    """One process, the whole global batch at once, torch's own clipping and AdamW."""
    model = make_mlp()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    rec: dict = {"loss": [], "norm": [], "grads": []}
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        rec["loss"].append(loss.item())
        rec["grads"].append([p.grad.reshape(-1).tolist() for p in params])
        rec["norm"].append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
    rec["params"] = [p.detach().reshape(-1).tolist() for p in params]
    return rec


def assert_close_lists(a, b, tol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=tol, atol=tol)


def test_zero_and_plain_dp2_match_single_process_adamw():
    ref = reference_adamw()
    zero, plain = run_distributed(_train_mlp, 2, [(True, "adamw"), (False, "adamw")])[0]
    assert zero["n_buckets"] > 2 and zero["n_micro"] == 2
    assert any(n > CLIP for n in ref["norm"])  # clipping is exercised
    for got in (zero, plain):
        assert_close_lists(got["loss"], ref["loss"])
        assert_close_lists(got["norm"], ref["norm"])
        for step in range(STEPS):
            assert_close_lists(got["grads"][step], ref["grads"][step])
        assert_close_lists(got["params"], ref["params"])
    # communication: none during the accumulating micro-batch, every bucket launched by backward
    # itself during the last one (overlapped), not left for finish_grad_sync
    assert zero["issued_in_backward"] == [0, zero["n_buckets"]] * STEPS
    # ZeRO leaves the first-needed bucket's all-gather in flight for the next forward; plain has none
    assert zero["in_flight"] == [1] * STEPS
    assert zero["in_flight_after_forward"] == [0] * STEPS  # the forward pre-hook waited for it
    assert plain["in_flight"] == [0] * STEPS


def test_zero_matches_plain_allreduce_with_lamb():
    zero, plain = run_distributed(_train_mlp, 2, [(True, "lamb"), (False, "lamb")])[0]
    assert_close_lists(zero["params"], plain["params"])
    assert_close_lists(zero["norm"], plain["norm"])
    initial = [p.detach().reshape(-1).tolist() for p in make_mlp().parameters()]
    assert any(not torch.allclose(torch.tensor(a), torch.tensor(b)) for a, b in zip(zero["params"], initial))


def _single_rank_checks(rank: int, world: int) -> dict:
    dims = ParallelDims(dp=1, tp=1, pp=1)
    dims.build_groups()
    model = make_mlp()
    excluded = model[5].weight
    excluded.norm_owner = False  # as TP does for replicated params of tp ranks > 0
    opt = DistributedOptimizer([model], dims, ParallelConfig(zero=True, bucket_mb=TINY_BUCKET_MB),
                               TrainConfig(grad_clip=0.0))
    x, y = global_batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    buffer = opt.chunks[0].grad_buffer
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * 4
    grads_in_buffer = all(lo <= p.grad.data_ptr() < hi for p in model.parameters())
    expected_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p is not excluded))
    norm = opt.step(LR)
    # forgetting set_sync(False) on an accumulating micro-batch is an error, not silent double counting
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    try:
        nn.functional.mse_loss(model(x), y).backward()
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    return {"in_buffer": grads_in_buffer, "norm": norm, "expected_norm": expected_norm, "error": message}


def test_grads_live_in_the_buffer_norm_owner_and_sync_misuse():
    out = run_distributed(_single_rank_checks, 1)[0]
    assert out["in_buffer"]
    assert math.isclose(out["norm"], out["expected_norm"], rel_tol=1e-5)
    assert "set_sync(False)" in out["error"]


def _train_gpt(rank: int, world: int, zero: bool) -> dict:
    from megascope.trainer.modeling.model import GPT

    dims = ParallelDims(dp=world, tp=1, pp=1)
    dims.build_groups()
    cfg = ModelConfig(n_layers=2, hidden=32, n_heads=2, seq_len=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = DistributedOptimizer([model], dims, ParallelConfig(dp=world, zero=zero, bucket_mb=0.02),
                               TrainConfig(optimizer="adamw", lr=LR, grad_clip=1.0))
    n_micro = 2
    per_rank = 8 // world
    mb = per_rank // n_micro
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step))
        tokens = tokens[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        total = torch.zeros(1)
        for m in range(n_micro):
            opt.set_sync(m == n_micro - 1)
            t = tokens[m * mb:(m + 1) * mb]
            loss = model.loss(model(t[:, :-1]), t[:, 1:]) / n_micro
            loss.backward()
            total += loss.detach()
        opt.finish_grad_sync()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        opt.step(LR)
    opt.wait_param_sync()
    return {"loss": losses, "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
            "n_buckets": len(opt.chunks[0].buckets)}


def test_gpt_zero_dp2_matches_one_process():
    single = run_distributed(_train_gpt, 1, True)[0]
    zero = run_distributed(_train_gpt, 2, True)[0]
    assert zero["n_buckets"] > 1
    assert_close_lists(zero["loss"], single["loss"])
    assert_close_lists(zero["params"], single["params"], tol=2e-5)
