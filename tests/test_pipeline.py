"""Pipeline pieces without a process group: chunk assignment, schedules, recomputation, FLOPs.
(The multi-process runs are in test_parity_3d.py.)"""

from __future__ import annotations

import pytest
import torch

from megascope.trainer.config import ModelConfig
from megascope.trainer.modeling.flops import (
    hardware_flops_per_step,
    megatron_full_recompute_flops,
    megatron_model_flops,
    model_flops_per_step,
)
from megascope.trainer.modeling.model import GPT
from megascope.trainer.modeling.recompute import apply_recompute
from megascope.trainer.pipelining.p2p import message_tag
from megascope.trainer.pipelining.pipeline import chunk_placements, split_into_chunks, tied_embedding_weight
from megascope.trainer.pipelining.schedule_order import (
    BACKWARD,
    FORWARD,
    analytical_bubble,
    build_schedule,
    interleaved_one_f_one_b,
    simulate,
)

LAYOUTS = [(1, 1, 4), (2, 1, 1), (2, 1, 4), (4, 1, 3), (4, 1, 8), (2, 2, 2), (2, 2, 6), (4, 2, 4),
           (4, 2, 8), (3, 3, 9), (4, 4, 16)]


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(n_layers=4, hidden=32, n_heads=4, seq_len=16, vocab_size=64)
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------------------------- assignment

def test_interleaved_assignment_follows_megatron():
    layers = {(p.stage, p.chunk): list(range(p.first_layer, p.first_layer + p.n_layers))
              for s in range(2) for p in chunk_placements(8, pp=2, vpp=2, stage=s)}
    assert layers == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    first, last = chunk_placements(8, 2, 2, 0)[0], chunk_placements(8, 2, 2, 1)[1]
    assert first.is_first and last.is_last and first.virtual_stage == 0 and last.virtual_stage == 3


@pytest.mark.parametrize("n_layers,pp,vpp", [(6, 4, 1), (4, 2, 3), (8, 3, 1)])
def test_invalid_split_is_refused_with_advice(n_layers, pp, vpp):
    with pytest.raises(ValueError, match="not divisible by pp\\*vpp"):
        chunk_placements(n_layers, pp, vpp, 0)


def test_interleaved_needs_micro_batches_divisible_by_pp():
    with pytest.raises(ValueError, match="divisible by pp"):
        interleaved_one_f_one_b(pp=4, vpp=2, stage=0, n_micro=6)


def _run_chunks_in_order(model: GPT, chunks_by_stage: list, tokens, targets) -> torch.Tensor:
    ordered = sorted((c for stage in chunks_by_stage for c in stage), key=lambda c: c.placement.virtual_stage)
    x = tokens
    for chunk in ordered[:-1]:
        x = chunk(x)
    return ordered[-1].loss(ordered[-1](x), targets)


def test_chunks_in_virtual_stage_order_compute_the_plain_model():
    cfg = tiny_cfg(n_layers=8, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, 64, (2, 17))
    expected = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    stages = [split_into_chunks(model, 8, pp=2, vpp=2, stage=s) for s in range(2)]
    got = _run_chunks_in_order(model, stages, tokens[:, :-1], tokens[:, 1:])
    assert torch.equal(got, expected)


def test_tied_embedding_gets_an_identical_copy_on_the_last_stage():
    torch.manual_seed(0)
    model = GPT(tiny_cfg())
    first = split_into_chunks(model, 4, pp=2, vpp=1, stage=0)
    last = split_into_chunks(model, 4, pp=2, vpp=1, stage=1)
    w_first, w_last = tied_embedding_weight(first), tied_embedding_weight(last)
    assert w_first is model.embed.weight and w_last is not w_first
    assert torch.equal(w_first, w_last)
    assert w_first.shared_embedding and w_last.shared_embedding
    assert getattr(w_first, "norm_owner", True) and w_last.norm_owner is False
    assert w_last in set(last[0].parameters()) and w_first not in set(last[0].parameters())
    # the two copies' gradients sum to the tied model's gradient
    tokens = torch.randint(0, 64, (2, 17))
    torch.manual_seed(0)
    tied = GPT(tiny_cfg())
    tied.loss(tied(tokens[:, :-1]), tokens[:, 1:]).backward()
    _run_chunks_in_order(model, [first, last], tokens[:, :-1], tokens[:, 1:]).backward()
    torch.testing.assert_close(w_first.grad + w_last.grad, tied.embed.weight.grad)


def test_single_stage_keeps_the_tie():
    torch.manual_seed(0)
    model = GPT(tiny_cfg())
    (chunk,) = split_into_chunks(model, 4, pp=1, vpp=1, stage=0)
    assert chunk.lm_head.weight is chunk.embed.weight
    assert tied_embedding_weight([chunk]) is None


# ------------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("pp,vpp,m", LAYOUTS)
def test_every_stage_runs_each_forward_and_backward_once_in_order(pp, vpp, m):
    if vpp > 1 and m % pp:
        pytest.skip("interleaved needs m % pp == 0")
    for stage in range(pp):
        actions = build_schedule(pp, vpp, stage, m)
        keys = [(a.kind, a.chunk, a.microbatch) for a in actions]
        expected = {(k, c, mb) for k in (FORWARD, BACKWARD) for c in range(vpp) for mb in range(m)}
        assert len(keys) == len(expected) and set(keys) == expected
        for c in range(vpp):
            for mb in range(m):
                assert keys.index((FORWARD, c, mb)) < keys.index((BACKWARD, c, mb))


@pytest.mark.parametrize("pp,vpp,m", LAYOUTS)
def test_simulated_bubble_equals_the_analytical_one(pp, vpp, m):
    if vpp > 1 and m % pp:
        pytest.skip("interleaved needs m % pp == 0")
    ideal = 3.0 * m  # forward 1 + backward 2 per micro-batch per stage
    makespan = simulate(pp, vpp, m)  # also proves the schedules deadlock-free
    bubble = (makespan - ideal) / ideal
    if m >= pp:
        assert bubble == pytest.approx(analytical_bubble(pp, vpp, m))
    else:  # fewer micro-batches than stages: worse than the formula, never better
        assert bubble >= analytical_bubble(pp, vpp, m)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 2)])
def test_one_f_one_b_bounds_activations_in_flight(pp, m):
    """PipeDream-Flush's point: stage s keeps at most pp - s micro-batches' activations."""
    for stage in range(pp):
        live = peak = 0
        for a in build_schedule(pp, 1, stage, m):
            live += 1 if a.kind == FORWARD else -1
            peak = max(peak, live)
        assert peak == min(pp - stage, m)


def test_single_stage_schedule_is_forward_backward_per_micro_batch():
    assert [repr(a) for a in build_schedule(1, 1, 0, 3)] == ["F0.0", "B0.0", "F0.1", "B0.1", "F0.2", "B0.2"]


def test_message_tags_are_unique_per_tensor():
    tags = {message_tag(vs, mb, 4, d) for vs in range(8) for mb in range(4) for d in ("forward", "backward")}
    assert len(tags) == 8 * 4 * 2


# ------------------------------------------------------------------------------- recomputation

@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_identical_gradients(mode):
    tokens = torch.randint(0, 64, (2, 17))
    grads = []
    for recompute in ("none", mode):
        torch.manual_seed(0)
        model = GPT(tiny_cfg(window=5))
        wrapped = apply_recompute([model], recompute)
        assert wrapped == (0 if recompute == "none" else 4)
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()  # parameter names unchanged
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6)


def test_recompute_mode_is_checked():
    with pytest.raises(ValueError, match="none, selective, full"):
        apply_recompute([], "some")


# ------------------------------------------------------------------------------- FLOPs

def test_model_flops_reduce_to_megatron_formula():
    cfg = ModelConfig(n_layers=24, hidden=2048, n_heads=16, seq_len=2048, vocab_size=51200)
    assert model_flops_per_step(cfg, 512) == pytest.approx(megatron_model_flops(cfg, 512), rel=1e-12)
    assert hardware_flops_per_step(cfg, 512, "none") == model_flops_per_step(cfg, 512)
    assert hardware_flops_per_step(cfg, 512, "full") == pytest.approx(
        megatron_full_recompute_flops(cfg, 512), rel=1e-12)


def test_sliding_window_scales_only_the_attention_term():
    full = ModelConfig(n_layers=4, hidden=256, n_heads=4, seq_len=1024, vocab_size=256)
    windowed = ModelConfig(n_layers=4, hidden=256, n_heads=4, seq_len=1024, vocab_size=256, window=256)
    b, s, L, h = 8, 1024, 4, 256
    attention_saved = 3 * b * s * L * 4 * h * (1024 - 256)  # fwd+bwd of QK^T and AV on 768 fewer keys
    assert model_flops_per_step(full, b) - model_flops_per_step(windowed, b) == pytest.approx(attention_saved)
    wide = ModelConfig(n_layers=4, hidden=256, n_heads=4, seq_len=1024, vocab_size=256, window=4096)
    assert model_flops_per_step(wide, b) == model_flops_per_step(full, b)


def test_selective_recompute_costs_between_none_and_full():
    cfg = tiny_cfg()
    none, sel, full = (hardware_flops_per_step(cfg, 8, m) for m in ("none", "selective", "full"))
    assert none < sel < full
    with pytest.raises(ValueError):
        hardware_flops_per_step(cfg, 8, "partial")
