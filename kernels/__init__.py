"""Fused operators with a plain PyTorch reference each (Triton on GPU when it imports)."""

from megascope.kernels.attention import attention_reference, causal_attention, sdpa_attention, window_mask
from megascope.kernels.bias_gelu import bias_gelu, bias_gelu_reference
from megascope.kernels.layernorm import LayerNorm, layer_norm, layer_norm_reference

__all__ = [
    "LayerNorm", "attention_reference", "bias_gelu", "bias_gelu_reference", "causal_attention",
    "layer_norm", "layer_norm_reference", "sdpa_attention", "window_mask",
]
