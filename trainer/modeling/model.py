"""A decoder-only GPT (pre-LayerNorm, learned positions, GeLU MLP) with MegaScale's options.

No distributed code here: tensor/sequence parallelism (`tensor_parallel.apply_tp`) swaps submodules
of this plain model, and the pipeline splits `blocks` into stages. The pieces a pipeline stage needs
are separate: `embed_tokens` (first stage), `blocks`, `head` and `loss` (last stage).

Shapes: tokens [b, s]; hidden states between blocks [b, s_local, h] where s_local = s / tp under
sequence parallelism and s otherwise; logits [b, s, vocab_local] (vocab / tp under tensor parallelism).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from megascope.kernels.attention import causal_attention
from megascope.kernels.bias_gelu import bias_gelu
from megascope.kernels.layernorm import LayerNorm
from megascope.trainer.config import ModelConfig

INIT_STD = 0.02


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d) + causal/window mask) V on [b, heads, s, d]: no parameters, so selective
    recomputation can wrap exactly this (it holds the s^2 activations)."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, self.window)

    def extra_repr(self) -> str:
        return f"window={self.window}"


class Attention(nn.Module):
    """qkv projection (per-head interleaved [head, q|k|v, d] rows, so a contiguous split of the
    output dim is a split by heads), attention core, output projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.n_heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.core: nn.Module = AttentionCore(cfg.window)  # replaceable (Block.attention_core)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, _ = qkv.shape
        # Heads are read off the projection's width: under tensor parallelism it holds heads/tp.
        qkv = qkv.view(b, s, -1, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        out = self.core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """fc1 -> fused bias+GeLU -> fc2; fc1's bias is applied by the fused kernel, not by the linear."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.hidden * cfg.ffn_mult)
        self.fc2 = nn.Linear(cfg.hidden * cfg.ffn_mult, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(bias_gelu(linear_without_bias(self.fc1, x), self.fc1.bias))


def linear_without_bias(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x W^T without the layer's bias; tensor-parallel layers provide their own `forward_without_bias`
    (which also does their communication)."""
    forward_without_bias = getattr(layer, "forward_without_bias", None)
    if forward_without_bias is not None:
        return forward_without_bias(x)
    return F.linear(x, cast(torch.Tensor, layer.weight))  # an nn.Linear's weight


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)); with `parallel_block`
    (MegaScale 3.1) one LayerNorm feeds both: x + attn(ln_1(x)) + mlp(ln_1(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel_block = cfg.parallel_block
        self.ln_1 = LayerNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = None if cfg.parallel_block else LayerNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    @property
    def attention_core(self) -> nn.Module:
        """The parameter-free attention core (the selective-recomputation target)."""
        return self.attn.core

    def __setattr__(self, name: str, value: torch.Tensor | nn.Module) -> None:
        # nn.Module.__setattr__ would register an assigned module under the name "attention_core"
        # instead of calling a property setter; route it to the attention's core explicitly.
        if name == "attention_core":
            if not isinstance(value, nn.Module):
                raise TypeError(f"attention_core takes a module, got {type(value).__name__}")
            self.attn.core = value
            return
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_block:
            y = self.ln_1(x)
            return x + self.attn(y) + self.mlp(y)
        x = x + self.attn(self.ln_1(x))
        assert self.ln_2 is not None  # present unless parallel_block
        return x + self.mlp(self.ln_2(x))


class TokenEmbedding(nn.Embedding):
    """Token ids [b, s] -> [b, s, h]. Tensor parallelism replaces it with a vocab-parallel one whose
    output is already reduced (and split along the sequence under sequence parallelism)."""


class PositionEmbedding(nn.Module):
    """Learned positions; `forward(seq_local)` returns the rows this rank's tokens use. The plain
    model's tokens start at 0; sequence parallelism offsets them by the rank's sequence chunk."""

    def __init__(self, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq_len, hidden))

    def first_position(self, seq_local: int) -> int:
        return 0

    def forward(self, seq_local: int) -> torch.Tensor:
        start = self.first_position(seq_local)
        if start + seq_local > self.weight.shape[0]:
            raise ValueError(f"sequence of {start + seq_local} tokens exceeds seq_len={self.weight.shape[0]}; "
                             "raise model.seq_len or feed shorter samples")
        return self.weight[start:start + seq_local]


class CrossEntropy(nn.Module):
    """Mean token cross-entropy; tensor parallelism swaps in the vocab-parallel one."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.n_heads:
            raise ValueError(f"hidden={cfg.hidden} is not divisible by n_heads={cfg.n_heads}")
        if cfg.window < 0:
            raise ValueError(f"window must be >= 0 (0 = full causal attention), got {cfg.window}")
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.hidden)
        self.pos = PositionEmbedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = LayerNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.loss_fn = CrossEntropy()
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by
        1/sqrt(2 * n_layers) so the residual stream's variance does not grow with depth.
        Runs in module order, so `torch.manual_seed(seed); GPT(cfg)` is identical on every rank."""
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attn.proj") or name.endswith("mlp.fc2")
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Embedding, PositionEmbedding)):
                nn.init.normal_(module.weight, 0.0, INIT_STD)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [b, s_local, h] hidden states (token + position embeddings)."""
        x = self.embed(tokens)
        return x + self.pos(x.shape[1])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, s_local, h] -> logits [b, s, vocab_local]: final LayerNorm and the output projection."""
        return self.lm_head(self.norm_f(hidden))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar mean cross-entropy over all b*s tokens."""
        return self.loss_fn(logits, targets)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def num_params(self) -> int:
        """Unique parameters (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())
