"""3D parallelism (real multi-process gloo) matches one process running the same model and seed.

The reference is written in plain torch, independent of the trainer's parallel code: the full GPT,
the whole global batch at once, clip_grad_norm_, torch.optim.AdamW (decay on matrices only).
Every layout trains 10 steps in fp32 and must reproduce the reference's loss and gradient norm at
every step to a tight tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from megascope.samples.distributed import run_distributed
from megascope.trainer.config import JobConfig, micro_batches
from megascope.trainer.lr_schedule import learning_rate
from megascope.trainer.modeling.model import GPT

STEPS = 10
BASE = {
    "model": {"n_layers": 4, "hidden": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 64},
    "train": {"global_batch": 8, "micro_batch": 2, "steps": STEPS, "lr": 1e-2, "warmup_steps": 2,
              "grad_clip": 1.0, "seed": 7},
    "trace": {"enabled": False},
}
RTOL = 2e-5


def make_cfg(parallel: dict) -> JobConfig:
    data = {k: dict(v) for k, v in BASE.items()}
    data["parallel"] = parallel
    return JobConfig.from_dict(data)


def global_batches(cfg: JobConfig) -> torch.Tensor:
    """[steps, global_batch, seq_len + 1] token ids, the same for every layout: counting sequences
    (next = previous + stride) from random starts, so there is something to learn and the loss falls."""
    g = torch.Generator().manual_seed(99)
    t, v = cfg.train, cfg.model.vocab_size
    start = torch.randint(0, v, (t.steps, t.global_batch, 1), generator=g)
    stride = torch.randint(1, 3, (t.steps, t.global_batch, 1), generator=g)
    return (start + stride * torch.arange(cfg.model.seq_len + 1)) % v


def dp_slice(cfg: JobConfig, batch: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """This dp rank's samples as [n_micro, micro_batch, seq_len + 1]."""
    n_micro, mb = micro_batches(cfg), cfg.train.micro_batch
    per_rank = batch[dp_rank * n_micro * mb:(dp_rank + 1) * n_micro * mb]
    return per_rank.reshape(n_micro, mb, -1)


def reference_run(cfg: JobConfig) -> list[tuple[float, float]]:
    """Single process, plain torch: loss and pre-clip grad norm per step."""
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    t = cfg.train
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    out = []
    for step, batch in enumerate(global_batches(cfg)):
        for group in opt.param_groups:
            group["lr"] = learning_rate(t, step)
        opt.zero_grad()
        loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        out.append((loss.item(), norm.item()))
    return out


def train_ranks(rank: int, world: int, parallel: dict, want_bytes: bool = False) -> dict:
    """Worker: build the 3D-parallel job from the config and train STEPS steps."""
    from megascope.trainer.parallel.parallel_dims import ParallelDims
    from megascope.trainer.parallel.parallelize import parallelize
    from megascope.trainer.robust.faults import Faults
    from megascope.trainer.step import train_step

    cfg = make_cfg(parallel)
    p = cfg.parallel
    dims = ParallelDims(p.dp, p.tp, p.pp, p.vpp)
    dims.build_groups()
    state = parallelize(cfg, dims, torch.device("cpu"), Faults([], rank))
    dp_rank = dims.coords(rank).dp
    history = []
    for step, batch in enumerate(global_batches(cfg)):
        result = train_step(state, dp_slice(cfg, batch, dp_rank), learning_rate(cfg.train, step))
        history.append((result.loss, result.grad_norm))
    out = {"history": history, "last_stage": state.is_last_stage}
    if want_bytes and state.pipe is not None:
        out["bytes_sent"] = state.pipe.bytes_sent
    return out


def losses_of(results: list[dict]) -> list[list[float]]:
    """Per step, the loss from rank 0 (which receives it) and every last-stage rank."""
    return [[r["history"][s][0] for i, r in enumerate(results) if i == 0 or r["last_stage"]]
            for s in range(STEPS)]


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def assert_matches(results: list[dict], reference: list[tuple[float, float]]) -> None:
    for step, ((ref_loss, ref_norm), losses) in enumerate(zip(reference, losses_of(results))):
        for loss in losses:
            assert loss == pytest.approx(ref_loss, rel=RTOL), f"step {step}: loss {loss} vs {ref_loss}"
        for r in results:
            norm = r["history"][step][1]
            assert norm == pytest.approx(ref_norm, rel=1e-4), f"step {step}: grad norm {norm} vs {ref_norm}"
    for i, r in enumerate(results):  # off the last stage (rank 0 aside) there is no loss
        if i != 0 and not r["last_stage"]:
            assert all(math.isnan(loss) for loss, _ in r["history"])


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, float]]:
    return reference_run(make_cfg({}))


def test_reference_loss_falls(reference):
    assert reference[-1][0] < reference[0][0]


def test_dp2_tp2_pp2_matches_single_process(reference):
    parallel = {"dp": 2, "tp": 2, "pp": 2}
    assert_matches(run_distributed(train_ranks, 8, parallel), reference)


def test_interleaved_pp2_vpp2_matches_single_process_and_1f1b(reference):
    interleaved = run_distributed(train_ranks, 2, {"pp": 2, "vpp": 2})
    assert_matches(interleaved, reference)
    one_f_one_b = run_distributed(train_ranks, 2, {"pp": 2})
    assert flat(losses_of(one_f_one_b)) == pytest.approx(flat(losses_of(interleaved)), rel=1e-6)


def test_dp2_pp2_vpp2_with_plain_all_reduce_matches(reference):
    assert_matches(run_distributed(train_ranks, 4, {"dp": 2, "pp": 2, "vpp": 2, "zero": False}), reference)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_changes_nothing(reference, mode):
    assert_matches(run_distributed(train_ranks, 2, {"pp": 2, "recompute": mode}), reference)


def test_scatter_gather_same_numbers_fewer_bytes(reference):
    """tp=2 without sequence parallelism: the boundary activation is replicated over tp, so with
    scatter/gather each rank sends half of it."""
    base = {"tp": 2, "pp": 2, "sequence_parallel": False}
    on = run_distributed(train_ranks, 4, {**base, "scatter_gather": True}, True)
    off = run_distributed(train_ranks, 4, {**base, "scatter_gather": False}, True)
    assert_matches(on, reference)
    assert losses_of(on) == losses_of(off)  # bit-identical: only the transport changed
    sent_on, sent_off = sum(r["bytes_sent"] for r in on), sum(r["bytes_sent"] for r in off)
    assert sent_off > 0 and sent_on * 2 == sent_off
