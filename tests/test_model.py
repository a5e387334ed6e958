"""The plain GPT: shapes, deterministic init, tying, causal/window masking, the parallel block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megascope.trainer.config import ModelConfig
from megascope.trainer.modeling.model import GPT, Block

SMALL = dict(vocab_size=64, n_layers=2, hidden=32, n_heads=4, seq_len=16, ffn_mult=2)


def _model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**{**SMALL, **overrides}))


def _tokens(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_pipeline_pieces_compose() -> None:
    model, tokens = _model(), _tokens()
    hidden = model.embed_tokens(tokens)
    assert hidden.shape == (2, 16, 32)
    for block in model.blocks:
        hidden = block(hidden)
    logits = model.head(hidden)
    assert logits.shape == (2, 16, 64)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
    loss = model.loss(logits, tokens)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 64), tokens.reshape(-1)))


def test_init_is_deterministic_from_the_seed_and_gpt2_scaled() -> None:
    a, b, c = _model(3), _model(3), _model(4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)
    big = _model(0, hidden=256, n_heads=4, n_layers=8)
    assert big.blocks[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.blocks[0].mlp.fc2.weight.std().item() == pytest.approx(0.02 / 4.0, rel=0.05)  # 1/sqrt(2*8)
    assert torch.count_nonzero(big.blocks[0].attn.qkv.bias) == 0
    assert torch.equal(big.norm_f.weight, torch.ones(256))


def test_tied_and_untied_heads() -> None:
    tied, untied = _model(), _model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.num_params() == tied.num_params() + 64 * 32


@pytest.mark.parametrize("window", [0, 4])
def test_attention_is_causal_and_windowed(window: int) -> None:
    model = _model(n_layers=1, window=window).eval()
    tokens = _tokens(batch=1)
    changed_at = 6
    perturbed = tokens.clone()
    perturbed[0, changed_at] = (tokens[0, changed_at] + 1) % 64
    diff = (model(tokens) - model(perturbed)).abs().amax(dim=-1)[0]
    assert torch.all(diff[:changed_at] == 0), "a token influenced earlier positions"
    reach = range(changed_at, 16) if window == 0 else range(changed_at, changed_at + window)
    assert all(diff[i] > 0 for i in reach)
    if window:  # one layer: position i sees tokens i-w+1..i only
        assert torch.all(diff[changed_at + window:] == 0), "a token leaked past the window"


def test_window_covering_the_sequence_is_full_attention() -> None:
    tokens = _tokens()
    torch.testing.assert_close(_model(window=16)(tokens), _model(window=0)(tokens))
    torch.testing.assert_close(_model(window=100)(tokens), _model(window=0)(tokens))


def test_parallel_block_shares_one_layernorm() -> None:
    torch.manual_seed(0)
    block = Block(ModelConfig(**SMALL, parallel_block=True))
    assert block.ln_2 is None
    x = torch.randn(2, 16, 32)
    y = block.ln_1(x)
    torch.testing.assert_close(block(x), x + block.attn(y) + block.mlp(y))
    sequential = Block(ModelConfig(**SMALL))
    assert sequential.ln_2 is not None


def test_attention_core_is_swappable() -> None:
    model, calls = _model(), []

    class Counting(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, q, k, v):
            calls.append(q.shape)
            return self.inner(q, k, v)

    expected = model(_tokens())
    for block in model.blocks:
        block.attention_core = Counting(block.attention_core)
    torch.testing.assert_close(model(_tokens()), expected)
    assert calls == [(2, 4, 16, 8)] * 2


def test_bad_shapes_are_refused_with_a_hint() -> None:
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        GPT(ModelConfig(**{**SMALL, "hidden": 30}))
    with pytest.raises(ValueError, match="exceeds seq_len"):
        _model()(_tokens(seq=17))


def test_a_few_steps_fit_one_batch() -> None:
    model, tokens = _model(parallel_block=True, window=4), _tokens(seq=17)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("options", [{}, {"parallel_block": True}, {"tie_embeddings": False, "ffn_mult": 2}])
def test_parameter_count_from_the_shape_equals_the_built_model(options: dict) -> None:
    from megascope.trainer.modeling.flops import parameter_count

    cfg = ModelConfig(n_layers=3, hidden=64, n_heads=4, seq_len=32, **options)
    assert parameter_count(cfg) == GPT(cfg).num_params()
