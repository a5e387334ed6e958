"""FLOPs per training step: model FLOPs (what MFU counts) and hardware FLOPs (what the device ran).

Megatron-LM (Narayanan et al., SC21, appendix) counts, per token and per layer, the forward as
24h^2 for the dense matmuls (QKV 6h^2, output projection 2h^2, MLP 16h^2 at ffn_mult=4) plus 4sh for
the attention scores and their product with V, and the logits as 2hV per token. Backward costs twice
the forward, so without recomputation

    model FLOPs = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))

With a sliding window of w tokens each query meets min(w, s) keys instead of s, so the attention-score
term uses s_eff = min(w, s); an MLP width other than 4h replaces 16h^2 by 4*ffn_mult*h^2. Both reduce to
the formula above for the default shape.

Hardware FLOPs add what recomputation re-runs in backward (MFU keeps using model FLOPs only):
full recomputation repeats each layer's forward (Megatron's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)));
selective recomputation repeats only the attention core (4 s_eff h per token per layer).
"""

from __future__ import annotations

from megascope.trainer.config import RECOMPUTE_MODES, ModelConfig


def attention_keys_per_query(cfg: ModelConfig) -> int:
    """Keys each query is scored against in the FLOP count: s, or the window w when it is shorter."""
    return min(cfg.window, cfg.seq_len) if cfg.window > 0 else cfg.seq_len


def _layer_forward_flops_per_token(cfg: ModelConfig) -> tuple[float, float]:
    """(dense matmul FLOPs, attention-core FLOPs) of one layer's forward for one token."""
    h = cfg.hidden
    dense = 2 * (3 * h * h) + 2 * (h * h) + 2 * 2 * (h * cfg.ffn_mult * h)  # qkv, proj, fc1+fc2
    core = 2 * 2 * attention_keys_per_query(cfg) * h  # Q K^T and (scores) V
    return float(dense), float(core)


def _logits_forward_flops_per_token(cfg: ModelConfig) -> float:
    return 2.0 * cfg.hidden * cfg.vocab_size


def model_flops_per_step(model_cfg: ModelConfig, global_batch: int) -> float:
    """FLOPs of one optimizer step's forward and backward over `global_batch` samples, without
    recomputation (the numerator of MFU). 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) for the default shape."""
    tokens = global_batch * model_cfg.seq_len
    dense, core = _layer_forward_flops_per_token(model_cfg)
    forward = model_cfg.n_layers * (dense + core) + _logits_forward_flops_per_token(model_cfg)
    return 3.0 * tokens * forward


def hardware_flops_per_step(model_cfg: ModelConfig, global_batch: int, recompute: str = "none") -> float:
    """FLOPs the devices actually execute per step, including the forward work that activation
    recomputation repeats in backward (full: every layer, 96 B s l h^2 (...); selective: attention core)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute '{recompute}' unknown; use one of {', '.join(RECOMPUTE_MODES)}")
    tokens = global_batch * model_cfg.seq_len
    dense, core = _layer_forward_flops_per_token(model_cfg)
    repeated = {"none": 0.0, "selective": core, "full": dense + core}[recompute]
    return model_flops_per_step(model_cfg, global_batch) + tokens * model_cfg.n_layers * repeated


def megatron_model_flops(model_cfg: ModelConfig, global_batch: int) -> float:
    """The paper's closed form (full attention, ffn_mult=4), kept to check the general count against."""
    b, s, L, h, v = global_batch, model_cfg.seq_len, model_cfg.n_layers, model_cfg.hidden, model_cfg.vocab_size
    return 72.0 * b * s * L * h * h * (1 + s / (6 * h) + v / (12 * L * h))


def megatron_full_recompute_flops(model_cfg: ModelConfig, global_batch: int) -> float:
    """Megatron's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)): hardware FLOPs with full recomputation."""
    b, s, L, h, v = global_batch, model_cfg.seq_len, model_cfg.n_layers, model_cfg.hidden, model_cfg.vocab_size
    return 96.0 * b * s * L * h * h * (1 + s / (6 * h) + v / (16 * L * h))


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of `GPT(cfg)` (a tied head counted once), from the shape alone: the model need not
    be built (a 2B model takes seconds to initialize)."""
    h, f = cfg.hidden, cfg.hidden * cfg.ffn_mult
    norms = 2 * h * (1 if cfg.parallel_block else 2)
    block = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + norms
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + cfg.seq_len * h + cfg.n_layers * block + 2 * h + head
