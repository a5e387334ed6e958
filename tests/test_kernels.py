"""Each fused kernel agrees with its plain PyTorch reference (CPU paths here; Triton on a GPU)."""

from __future__ import annotations

import pytest
import torch

from megascope.kernels import attention, layernorm
from megascope.kernels.attention import attention_reference, causal_attention, window_mask
from megascope.kernels.bias_gelu import bias_gelu, bias_gelu_reference

needs_gpu = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)
needs_triton = pytest.mark.skipif(not attention.HAS_TRITON, reason="needs triton")


def _grads(fn, *inputs: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    out.backward(g)
    return out.detach(), [leaf.grad for leaf in leaves]


def _assert_same(fast, ref, *inputs, rtol=1e-5, atol=1e-6) -> None:
    out_f, grads_f = _grads(fast, *inputs)
    out_r, grads_r = _grads(ref, *inputs)
    torch.testing.assert_close(out_f, out_r, rtol=rtol, atol=atol)
    for gf, gr in zip(grads_f, grads_r):
        torch.testing.assert_close(gf, gr, rtol=rtol, atol=atol)


def _ln_inputs(rows: int, hidden: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, 3, hidden, generator=g) * 2 + 0.5).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    b = (0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    return x, w, b


def test_layernorm_matches_reference() -> None:
    _assert_same(layernorm.layer_norm, layernorm.layer_norm_reference, *_ln_inputs(4, 48))
    module = layernorm.LayerNorm(48)
    torch.testing.assert_close(module(_ln_inputs(4, 48)[0]), torch.nn.LayerNorm(48)(_ln_inputs(4, 48)[0]))


def test_bias_gelu_matches_reference() -> None:
    x = torch.randn(5, 7, 24, generator=torch.Generator().manual_seed(1)) * 3
    b = torch.randn(24, generator=torch.Generator().manual_seed(2))
    _assert_same(bias_gelu, bias_gelu_reference, x, b, atol=1e-5)  # dgelu is ~0 in the far tail


def test_window_mask_semantics() -> None:
    mask = window_mask(5, 2)
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    assert torch.equal(mask, expected.bool())
    assert torch.equal(window_mask(4, 0), torch.ones(4, 4).tril().bool())


@pytest.mark.parametrize("window", [0, 1, 3, 12, 40])
def test_sdpa_attention_matches_reference(window: int) -> None:
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g) for _ in range(3))
    _assert_same(lambda *t: causal_attention(*t, window=window),
                 lambda *t: attention_reference(*t, window=window), q, k, v, atol=1e-5)


def test_attention_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="batch, heads, seq, head_dim"):
        causal_attention(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 4, 8))


@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_layernorm_matches_reference(dtype, tol) -> None:
    for hidden in (64, 1000, 4096):
        inputs = _ln_inputs(33, hidden, "cuda", dtype)
        _assert_same(layernorm.layer_norm, layernorm.layer_norm_reference, *inputs, rtol=tol, atol=tol)


@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_bias_gelu_matches_reference(dtype, tol) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(17, 5, 3000, generator=g) * 3).to("cuda", dtype)
    b = torch.randn(3000, generator=g).to("cuda", dtype)
    _assert_same(bias_gelu, bias_gelu_reference, x, b, rtol=tol, atol=tol * 5)


@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq,head_dim,window", [(128, 64, 0), (100, 32, 0), (257, 128, 0), (257, 64, 17),
                                                 (300, 16, 64), (64, 64, 1)])
def test_triton_flash_attention_matches_reference(dtype, tol, seq, head_dim, window) -> None:
    g = torch.Generator().manual_seed(seq + window)
    q, k, v = (torch.randn(2, 3, seq, head_dim, generator=g).to("cuda", dtype) for _ in range(3))
    _assert_same(lambda *t: attention.flash_attention(*t, window=window),
                 lambda *t: attention_reference(*t, window=window), q, k, v, rtol=tol, atol=tol)


@needs_gpu
@needs_triton
def test_flash_attention_reads_strided_inputs() -> None:
    qkv = torch.randn(2, 50, 4, 3, 32, device="cuda")  # the model's per-head interleaved layout
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    torch.testing.assert_close(attention.flash_attention(q, k, v, 7), attention_reference(q, k, v, 7),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not attention.HAS_FLEX, reason="torch without FlexAttention")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [1, 17, 64, 300])
def test_flex_window_attention_matches_reference(window: int) -> None:
    """The block mask's semantics (i - window < j <= i), on FlexAttention's unfused CPU path."""
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, 3, 256, 32, generator=g) for _ in range(3))
    torch.testing.assert_close(attention.flex_window_attention(q, k, v, window, compiled=False),
                               attention_reference(q, k, v, window), rtol=2e-5, atol=2e-5)


@needs_gpu
@needs_triton
@pytest.mark.skipif(not attention.HAS_FLEX, reason="torch without FlexAttention")
@pytest.mark.parametrize("window", [17, 512])
def test_training_window_attention_gradients_match_reference(window: int) -> None:
    """causal_attention with gradients takes the compiled FlexAttention path on CUDA; output and every
    input gradient match the fp32 reference (bf16 tolerance)."""
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, 4, 1024, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    grad = torch.randn(2, 4, 1024, 64, generator=g).to("cuda", torch.bfloat16)
    out = causal_attention(q, k, v, window)
    ref = attention_reference(q, k, v, window)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(ours, theirs, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("backend", attention.SDPA_BACKENDS)
def test_sdpa_preference_computes_the_same_attention(backend: str) -> None:
    """Every train.attention_backend gives the reference result; on the CPU cuDNN and flash do not
    apply and SDPA falls back to the next backend instead of failing."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    with attention.sdpa_preference(backend):
        _assert_same(causal_attention, attention_reference, q, k, v, atol=1e-5)


def test_sdpa_preference_refuses_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="cudnn"):
        with attention.sdpa_preference("fa9"):
            pass


@needs_gpu
@needs_triton
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_sdpa_preference_on_the_gpu_matches_reference(backend: str) -> None:
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 256, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    with attention.sdpa_preference(backend):
        _assert_same(causal_attention, attention_reference, q, k, v, rtol=2e-2, atol=2e-2)
