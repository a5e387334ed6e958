"""AdamW and LAMB on flat shards against torch.optim.AdamW and a plain per-tensor LAMB."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megascope.samples.distributed import run_distributed
from megascope.trainer.optimizers import LAMB_EPS, AdamW, Lamb, ShardLayout

BETAS = (0.9, 0.95)
WD = 0.1
LR = 1e-2
STEPS = 4


def toy_tensors(seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A matrix, a bias-like vector and a second matrix, plus a gradient per step for each."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (7,), (3, 4)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(STEPS)]
    return params, grads


def reference_lamb(params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """LAMB per tensor, straight from You et al. 2019 (bias-corrected); the trust ratio only for
    tensors that take weight decay (ndim >= 2), 1 when either norm is 0."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            m_hat = m[i] / (1 - BETAS[0] ** t)
            v_hat = v[i] / (1 - BETAS[1] ** t)
            decay = p.dim() >= 2
            u = m_hat / (v_hat.sqrt() + LAMB_EPS) + (WD * p if decay else 0)
            w_norm, u_norm = p.norm().item(), u.norm().item()
            ratio = w_norm / u_norm if decay and w_norm > 0 and u_norm > 0 else 1.0
            p -= LR * ratio * u
    return params


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_adamw_matches_torch_adamw():
    params, grads = toy_tensors()
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    torch_opt = torch.optim.AdamW([{"params": [ref[0], ref[2]], "weight_decay": WD},
                                   {"params": [ref[1]], "weight_decay": 0.0}], lr=LR, betas=BETAS)
    layout = ShardLayout.for_tensors(params)
    ours = AdamW(layout, BETAS, WD)
    master = flat(params)
    for step_grads in grads:
        for p, g in zip(ref, step_grads):
            p.grad = g.clone()
        torch_opt.step()
        ours.step(master, flat(step_grads), LR)
    torch.testing.assert_close(master, flat([p.detach() for p in ref]), rtol=1e-6, atol=1e-7)
    assert ours.step_count == STEPS


def test_lamb_unsharded_matches_reference():
    params, grads = toy_tensors()
    expected = reference_lamb(params, grads)
    ours = Lamb(ShardLayout.for_tensors(params), BETAS, WD)
    master = flat(params)
    for step_grads in grads:
        ours.step(master, flat(step_grads), LR)
    torch.testing.assert_close(master, flat(expected), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(master, flat(params))  # it did move


def test_lamb_zero_norm_guard_keeps_ratio_one():
    params = [torch.zeros(3, 3)]
    ours = Lamb(ShardLayout.for_tensors(params), BETAS, WD)
    master = flat(params)
    ours.step(master, torch.ones(9), LR)
    assert torch.isfinite(master).all()
    # ||w|| = 0 -> ratio 1 -> plain first Adam step of size lr
    torch.testing.assert_close(master, torch.full((9,), -LR), rtol=1e-5, atol=1e-7)


def _sharded_lamb(rank: int, world: int, mode: str) -> list[float]:
    """mode dp: each rank holds half of the concatenation (cut mid-tensor, second half padded).
    mode tp: the first matrix is split by rows across ranks (tp_sharded), the rest replicated."""
    params, grads = toy_tensors()
    group = dist.group.WORLD
    if mode == "dp":
        ids_full = ShardLayout.for_tensors(params)
        n = ids_full.numel
        shard = -(-n // world)
        lo, hi = rank * shard, min((rank + 1) * shard, n)
        pad = shard - (hi - lo)
        layout = ShardLayout(
            torch.cat([ids_full.segment_ids[lo:hi], torch.full((pad,), len(params))]), len(params),
            torch.cat([ids_full.decay_mask[lo:hi], torch.zeros(pad)]), ids_full.tp_sharded)
        opt = Lamb(layout, BETAS, WD, dp_group=group)
        master = torch.cat([flat(params)[lo:hi], torch.zeros(pad)])
        for step_grads in grads:
            opt.step(master, torch.cat([flat(step_grads)[lo:hi], torch.zeros(pad)]), LR)
        return master[:hi - lo].tolist()
    rows = params[0].shape[0] // world
    local = [params[0][rank * rows:(rank + 1) * rows]] + params[1:]
    opt = Lamb(ShardLayout.for_tensors(local, tp_sharded=[True, False, False]), BETAS, WD, tp_group=group)
    master = flat(local)
    for step_grads in grads:
        local_grads = [step_grads[0][rank * rows:(rank + 1) * rows]] + step_grads[1:]
        opt.step(master, flat(local_grads), LR)
    return master.tolist()


def test_lamb_sharded_over_dp2_matches_reference():
    params, grads = toy_tensors()
    expected = flat(reference_lamb(params, grads))
    shards = run_distributed(_sharded_lamb, 2, "dp")
    got = torch.tensor(shards[0] + shards[1])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_lamb_tp_sharded_param_uses_full_norm():
    params, grads = toy_tensors()
    expected = reference_lamb(params, grads)
    out = [torch.tensor(o) for o in run_distributed(_sharded_lamb, 2, "tp")]
    rows = params[0].numel() // 2
    got_matrix = torch.cat([out[0][:rows], out[1][:rows]])
    torch.testing.assert_close(got_matrix, expected[0].reshape(-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[0][rows:], flat(expected[1:]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[1][rows:], flat(expected[1:]), rtol=1e-6, atol=1e-7)



def test_adamw_decay_runs_and_their_complement_cover_the_shard():
    from megascope.trainer.optimizers import _complement

    params, _ = toy_tensors()
    layout = ShardLayout.for_tensors(params)  # matrix (30), vector (7), matrix (12)
    assert layout.decay_ranges() == [(0, 30), (37, 49)]
    assert _complement(layout.decay_ranges(), layout.numel) == [(30, 37)]
    assert _complement([], 5) == [(0, 5)] and _complement([(0, 5)], 5) == []
