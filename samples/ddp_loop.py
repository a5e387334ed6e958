"""A plain DistributedDataParallel training loop that megascope did not write, traced by attaching.

    torchrun --nproc-per-node 2 samples/ddp_loop.py --run-dir runs/ddp
    megascope analyze runs/ddp

The three lines marked `# megascope` are all the tracing: attach (run.json, the tracer, a DDP
communication hook timing every gradient bucket's all-reduce, forward/backward/optimizer spans from
hooks), the loader wrapped to time data waits, and t.step() at the end of each step.
`--slow-rank R --slow-ms MS` sleeps MS in rank R's forward from step `--slow-from` on: a straggler
that `megascope analyze` names; with `--slow-outside` the sleep is at the start of each step instead,
before its first traced span (host time of the rank: a late launch); with `--slow-loader` its data
loader takes MS longer per batch (inside the data wait t.data times); `--gc-objects N` makes rank R hold
N live objects and run a full gc.collect() every step from `--slow-from` on instead (GC pressure).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from megascope import tracer


class Mlp(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, 1)
        self.sleep_s = 0.0
        """Injected slowness: seconds slept in every forward (a slow rank)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.head(self.body(x))  # (batch, 1): no view of the output (FSDP2 warns on views)


def parse_args(argv: list[str] | None = None, run_dir: str = "runs/ddp-loop",
               description: str = __doc__.splitlines()[0]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--run-dir", default=run_dir)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--slow-rank", type=int, default=-1, help="rank whose forward sleeps (-1: none)")
    p.add_argument("--slow-ms", type=float, default=40.0)
    p.add_argument("--slow-from", type=int, default=8, help="first slow step")
    p.add_argument("--slow-outside", action="store_true",
                   help="the slow rank sleeps at the start of each step, before its first traced span (the data "
                        "fetch), outside any hooked span, instead of inside its forward")
    p.add_argument("--slow-loader", action="store_true",
                   help="the slow rank's data loader takes --slow-ms longer per batch, instead of its forward")
    p.add_argument("--gc-objects", type=int, default=0,
                   help="the slow rank holds this many live objects and runs gc.collect() every step, instead of "
                        "sleeping (0: off)")
    return p.parse_args(argv)


def slow_batches(loader, delay_s: float, slow_from: int):
    """The loader's batches, each from `slow_from` on `delay_s` late (a loader reading a slow disk)."""
    for i, batch in enumerate(loader):
        if i >= slow_from:
            time.sleep(delay_s)
        yield batch


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    train(args)
    # the DDP model (its reducer holds a Python communication hook) must be gone before the process
    # group: torch's own default Python hook aborted 2 of 10 gloo runs at exit ("terminate called
    # without an active exception") when the model outlived destroy_process_group; 0 of 15 with this
    gc.collect()
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(f"trace written to {args.run_dir}; read it with: megascope analyze {args.run_dir}")


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Mlp(args.width, args.depth)
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = args.steps * args.batch * dist.get_world_size()
    data = TensorDataset(torch.randn(n, args.width), torch.randn(n, 1))
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=False))

    elsewhere = args.slow_outside or args.slow_loader or args.gc_objects > 0  # not in the forward
    if args.slow_loader and rank == args.slow_rank:
        loader = slow_batches(loader, args.slow_ms / 1e3, args.slow_from)
    heap = [(i, str(i)) for i in range(args.gc_objects)] if rank == args.slow_rank else []

    with tracer.attach(args.run_dir, model=model, optimizer=opt) as t:                   # megascope
        for step, (x, y) in enumerate(t.data(loader)):                                    # megascope
            slow = rank == args.slow_rank and step >= args.slow_from
            net.sleep_s = args.slow_ms / 1e3 if slow and not elsewhere else 0.0
            if slow and heap:
                gc.collect()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t.step(tokens=len(x), loss=loss.item())                                       # megascope
            if args.slow_outside and rank == args.slow_rank and step + 1 >= args.slow_from:
                time.sleep(args.slow_ms / 1e3)  # the next step's start: before its data fetch, in no span
    del heap


if __name__ == "__main__":
    main()
