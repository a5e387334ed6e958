"""Tensor (+ sequence) parallelism equals the single-process model: same loss, same gradients."""

from __future__ import annotations

import pytest
import torch

from megascope.samples.distributed import run_distributed
from megascope.trainer.config import ModelConfig
from megascope.trainer.modeling.model import GPT
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.parallel.tensor_parallel import apply_tp, full_tensor, sync_tp_grads

SMALL = dict(vocab_size=64, n_layers=2, hidden=32, n_heads=4, seq_len=16, ffn_mult=2)

CASES = [
    ("tp", False, {}),
    ("tp+sp", True, {}),
    ("tp+sp parallel_block window", True, {"parallel_block": True, "window": 5}),
    ("tp parallel_block window", False, {"parallel_block": True, "window": 5}),
    ("tp+sp untied", True, {"tie_embeddings": False}),
]


def _batch(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _loss_and_grads(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = model.loss(model(tokens), targets)
    loss.backward()
    return loss.detach()


def _compare_case(dims: ParallelDims, sequence_parallel: bool, overrides: dict) -> dict:
    cfg = ModelConfig(**{**SMALL, **overrides})
    tokens, targets = _batch(cfg)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    ref_loss = _loss_and_grads(reference, tokens, targets)
    apply_tp(model, dims, sequence_parallel)
    loss = _loss_and_grads(model, tokens, targets)
    sync_tp_grads(model, dims)

    ref_params = dict(reference.named_parameters())
    errors, sq_norm = {}, torch.zeros(())
    for name, p in model.named_parameters():
        grad = full_tensor(p.grad, p, dims)
        errors[name] = (grad - ref_params[name].grad).abs().max().item()
        if getattr(p, "norm_owner", True):
            sq_norm += p.grad.pow(2).sum() if getattr(p, "tp_sharded", False) else grad.pow(2).sum()
    torch.distributed.all_reduce(sq_norm, group=dims.groups["tp"])
    ref_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in reference.parameters()))
    sharded = sorted(n for n, p in model.named_parameters() if getattr(p, "tp_sharded", False))
    partial = sorted(n for n, p in model.named_parameters() if getattr(p, "tp_grad_allreduce", False))
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_errors": errors,
            "norm": sq_norm.sqrt().item(), "ref_norm": ref_norm.item(),
            "ref_names": sorted(ref_params), "sharded": sharded, "partial": partial}


def _worker(rank: int, world: int, cases: list) -> list[dict]:
    dims = ParallelDims(dp=1, tp=world, pp=1)
    dims.build_groups()
    return [_compare_case(dims, sp, overrides) for _, sp, overrides in cases]


def _check(results: list[list[dict]], cases: list) -> None:
    for case_index, (label, sp, _) in enumerate(cases):
        for rank_results in results:
            r = rank_results[case_index]
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6), label
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), label
            assert sorted(r["grad_errors"]) == r["ref_names"], label
            worst = max(r["grad_errors"].items(), key=lambda kv: kv[1])
            assert worst[1] < 1e-6, f"{label}: gradient of {worst[0]} differs by {worst[1]:.3g}"
            assert "blocks.0.attn.qkv.weight" in r["sharded"] and "embed.weight" in r["sharded"]
            if sp:
                assert {"pos.weight", "norm_f.weight", "blocks.0.ln_1.bias",
                        "blocks.1.mlp.fc2.bias"} <= set(r["partial"])
            else:
                assert r["partial"] == []


@pytest.mark.slow
def test_tp2_matches_single_process() -> None:
    _check(run_distributed(_worker, 2, CASES), CASES)


@pytest.mark.slow
def test_tp4_sequence_parallel_matches_single_process() -> None:
    cases = [("tp4+sp window", True, {"window": 3})]
    _check(run_distributed(_worker, 4, cases), cases)
