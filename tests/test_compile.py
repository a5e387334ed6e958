"""train.compile: the compiled blocks compute the eager model's loss and gradients (CPU Inductor)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from megascope.trainer.config import ModelConfig
from megascope.trainer.modeling.compile import compile_blocks, compile_loss
from megascope.trainer.modeling.model import GPT


class _Chunk(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.blocks = model.blocks


def _assert_same_training(eager: GPT, compiled: GPT, seed: int) -> None:
    """Same loss and gradients from both models on one random batch."""
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(seed))
    losses = [m.loss(m(tokens[:, :-1]), tokens[:, 1:]) for m in (eager, compiled)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert a.grad is not None and b.grad is not None, name
        assert (b.grad - a.grad).norm() <= 1e-5 * a.grad.norm() + 1e-8, name


def test_compiled_blocks_match_eager() -> None:
    torch.manual_seed(0)
    eager = GPT(ModelConfig(n_layers=2, hidden=64, n_heads=4, seq_len=32))
    compiled = copy.deepcopy(eager)
    assert compile_blocks([_Chunk(compiled)]) == 2
    _assert_same_training(eager, compiled, seed=1)


def test_compiled_loss_matches_eager() -> None:
    """train.compile_loss: the compiled final LayerNorm and cross-entropy give the eager loss and
    gradients (the model itself is the last pipeline chunk here: it holds norm_f and loss_fn)."""
    torch.manual_seed(0)
    eager = GPT(ModelConfig(n_layers=1, hidden=64, n_heads=4, seq_len=32))
    compiled = copy.deepcopy(eager)
    assert compile_loss([compiled]) == 2
    _assert_same_training(eager, compiled, seed=2)


def test_compile_loss_leaves_a_chunk_without_the_head_alone() -> None:
    assert compile_loss([_Chunk(GPT(ModelConfig(n_layers=1, hidden=32, n_heads=2, seq_len=8)))]) == 0
