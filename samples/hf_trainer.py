"""A Hugging Face transformers.Trainer job megascope did not write, traced through a callback.

    pip install 'megascope[attach]'      # transformers, accelerate
    torchrun --nproc-per-node 2 samples/hf_trainer.py --run-dir runs/hf
    megascope analyze runs/hf

The Trainer wraps the model in DistributedDataParallel (gloo on CPU); the line marked `# megascope`
is all the tracing. `--slow-rank R --slow-ms MS` sleeps MS in rank R's forward from step `--slow-from`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from megascope.samples.ddp_loop import Mlp, parse_args
from megascope.tracer.hf_callback import MegascopeCallback


class Regressor(torch.nn.Module):
    """The DDP sample's MLP, with the Trainer's calling convention: keyword inputs, a dict with the loss."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = Mlp(width, depth)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def train(args: argparse.Namespace, out_dir: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)
    model = Regressor(args.width, args.depth)
    g = torch.Generator().manual_seed(1)
    n = args.steps * args.batch * int(os.environ.get("WORLD_SIZE", 1))
    xs, ys = torch.randn(n, args.width, generator=g), torch.randn(n, 1, generator=g)
    data = [{"x": xs[i], "labels": ys[i]} for i in range(n)]
    targs = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
                              use_cpu=True, ddp_backend="gloo", report_to="none", save_strategy="no",
                              logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
                              ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    slow = {"rank": args.slow_rank, "s": args.slow_ms / 1e3, "from": args.slow_from}

    def maybe_sleep(module: torch.nn.Module, inputs: object) -> None:  # the injected slow rank
        if rank == slow["rank"] and trainer.state.global_step >= slow["from"]:
            time.sleep(slow["s"])

    model.register_forward_pre_hook(maybe_sleep)
    trainer.add_callback(MegascopeCallback(trainer, args.run_dir))                            # megascope
    trainer.train()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, "runs/hf-trainer", __doc__.splitlines()[0])
    with tempfile.TemporaryDirectory() as out_dir:
        train(args, out_dir)
    if dist.is_initialized():
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"trace written to {args.run_dir}; read it with: megascope analyze {args.run_dir}")


if __name__ == "__main__":
    main()
