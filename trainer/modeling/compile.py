"""torch.compile per transformer block (`train.compile`).

Compiling each block rather than the whole stage keeps the pipeline schedule, the tracer's spans and
the data-parallel hooks in eager Python, where they run between blocks. All blocks share one code
object, so Dynamo compiles the block once (parameters are graph inputs) and reuses it for the rest.
Inside the compiled region the kernels take their plain torch paths (kernels/*.py check
`torch.compiler.is_compiling()`), which Inductor fuses with the neighbouring elementwise work.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from megascope.trainer.modeling.model import CrossEntropy


def compile_blocks(chunks: Sequence[nn.Module]) -> int:
    """Compile every transformer block of every chunk in place; returns how many were compiled."""
    compiled = 0
    for chunk in chunks:
        for block in getattr(chunk, "blocks", ()):
            block.compile()
            compiled += 1
    return compiled


def compile_loss(chunks: Sequence[nn.Module]) -> int:
    """Compile the last stage's final LayerNorm and cross-entropy (`train.compile_loss`); returns how
    many modules were compiled. Eager cross-entropy over [tokens, vocab] logits makes several passes
    over a tensor of ~1.6 GB at 8k tokens x 50k vocab in fp32 (upcast, log-softmax, gather, and as
    many again in backward); Inductor fuses them into one read of the bf16 logits each way. The
    vocab-parallel loss of tensor parallelism holds collectives and stays eager."""
    compiled = 0
    for chunk in chunks:
        loss_fn, norm_f = getattr(chunk, "loss_fn", None), getattr(chunk, "norm_f", None)
        if isinstance(loss_fn, CrossEntropy):
            loss_fn.compile()
            compiled += 1
        if isinstance(norm_f, nn.Module):
            norm_f.compile()
            compiled += 1
    return compiled
