"""A PyTorch Lightning job megascope did not write, traced through a callback.

    pip install 'megascope[attach]'      # lightning
    torchrun --nproc-per-node 2 samples/lightning_loop.py --run-dir runs/lightning
    megascope analyze runs/lightning

Lightning's DDP strategy (gloo on CPU) wraps the model in DistributedDataParallel; under torchrun it
takes the process group from torchrun's environment. The line marked `# megascope` is all the
tracing. `--slow-rank R --slow-ms MS` sleeps MS in rank R's forward from step `--slow-from`
(tests/test_attach_lightning.py slows a rank from outside the process instead).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from megascope.samples.ddp_loop import Mlp, parse_args
from megascope.tracer.lightning_callback import MegascopeCallback


class Regressor(pl.LightningModule):
    """The DDP sample's MLP as a LightningModule."""

    def __init__(self, width: int, depth: int, slow: dict) -> None:
        super().__init__()
        self.net, self.slow = Mlp(width, depth), slow

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.slow["rank"] and self.global_step >= self.slow["from"]:
            time.sleep(self.slow["s"])  # the injected slow rank
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def train(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = args.steps * args.batch * world
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, 1, generator=g))
    model = Regressor(args.width, args.depth, {"rank": args.slow_rank, "s": args.slow_ms / 1e3,
                                               "from": args.slow_from})
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=args.steps, max_epochs=1,
                         strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
                         callbacks=[MegascopeCallback(args.run_dir)],                         # megascope
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():  # a sample's tiny loader: Lightning's worker-count advice is noise here
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, DataLoader(data, batch_size=args.batch))  # the strategy adds a DistributedSampler


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, "runs/lightning", __doc__.splitlines()[0])
    train(args)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"trace written to {args.run_dir}; read it with: megascope analyze {args.run_dir}")


if __name__ == "__main__":
    main()
