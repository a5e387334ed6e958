"""Cost and noise model of the trace simulator: how long compute and transfers take, and how they vary.

Durations follow from the model shape and the device's peak FLOP/s (Megatron-LM's FLOP formula at a
fixed hardware efficiency) and from bytes over link bandwidth, so MFU and step times look like a real
job's. Noise: a persistent per-chip speed spread, per-op jitter, a per-step job-wide factor, host gaps
between ops and rare host hiccups, all of which a detector must tolerate on a clean run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = {"n_layers": 64, "hidden": 8192, "n_heads": 64, "seq_len": 4096,
                 "vocab_size": 50304, "window": 0, "ffn_mult": 4}


@dataclass
class Noise:
    chip_sigma: float = 0.003      # persistent per-rank speed spread (log-normal sigma)
    op_sigma: float = 0.015        # per compute op jitter
    step_sigma: float = 0.01       # job-wide per-step factor (data-dependent work)
    xfer_sigma: float = 0.05       # per transfer jitter
    gap_mean_s: float = 30e-6      # host gap between consecutive ops (exponential)
    data_wait_mean_s: float = 3e-4
    hiccup_prob: float = 3e-4      # per rank-step chance of a host pause before the gradient sync
    hiccup_s: tuple[float, float] = (2e-3, 8e-3)


@dataclass
class Costs:
    """Seconds per op at nominal speed, derived from the model and the layout."""
    forward_s: float
    backward_s: float
    optimizer_s: float
    p2p_bytes: int
    p2p_s: float
    tp_bytes: int
    tp_s: float
    dp_bytes: int
    dp_s: float
    model_flops_per_step: float
    tokens_per_replica: int


@dataclass
class Hardware:
    peak_flops: float = 989e12     # H100 SXM bf16 dense
    efficiency: float = 0.5        # achieved fraction of peak inside compute kernels
    p2p_bw: float = 25e9           # inter-node bytes/s (200 Gb/s NIC)
    tp_bw: float = 200e9           # intra-node NVLink bytes/s
    dp_bw: float = 25e9
    device: str = "NVIDIA H100 80GB HBM3 (simulated)"
    ranks_per_host: int = 8
    extra: dict = field(default_factory=dict)


def megatron_flops(model: dict, tokens: int) -> float:
    """Model FLOPs (fwd+bwd) for `tokens` tokens, Megatron-LM's formula without recomputation."""
    h, layers, s, v = model["hidden"], model["n_layers"], model["seq_len"], model["vocab_size"]
    # 72 B s l h^2 (1 + s/6h + V/12hl): fwd+bwd of attention, a 4h MLP and the logits layer
    return 72.0 * tokens * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))


def costs(model: dict, dp: int, tp: int, pp: int, vpp: int, micro_batches: int,
          micro_batch_size: int, hw: Hardware) -> Costs:
    h, s = model["hidden"], model["seq_len"]
    tokens_mb = micro_batch_size * s
    flops_mb = megatron_flops(model, tokens_mb)          # fwd+bwd, whole model, one micro-batch
    per_chunk = flops_mb / (pp * vpp * tp)
    fwd = per_chunk / 3 / (hw.peak_flops * hw.efficiency)
    params_rank = 12 * h * h * model["n_layers"] / (pp * tp)
    act_bytes = tokens_mb * h * 2                         # bf16 activations of one micro-batch
    grad_bytes = int(params_rank * 2)
    ring = (dp - 1) / dp if dp > 1 else 0.0
    return Costs(
        forward_s=fwd, backward_s=2 * fwd,
        optimizer_s=params_rank / dp * 16 / 1.5e12 + 2e-3,   # memory-bound update of the local shard
        p2p_bytes=act_bytes // tp, p2p_s=act_bytes / tp / hw.p2p_bw,
        tp_bytes=act_bytes, tp_s=act_bytes * 2 * (tp - 1) / tp / hw.tp_bw,
        dp_bytes=grad_bytes, dp_s=grad_bytes * ring / hw.dp_bw,
        model_flops_per_step=flops_mb * micro_batches * dp,
        tokens_per_replica=tokens_mb * micro_batches,
    )
