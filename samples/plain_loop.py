"""Tracing a plain PyTorch training loop with megascope.tracer (no megascope trainer needed).

    torchrun --nproc-per-node 2 samples/plain_loop.py --run-dir runs/plain     # or: python samples/plain_loop.py
    megascope analyze runs/plain

The lines marked `# trace` are all it takes: `tracer.attach` writes run.json (the topology: every
rank data parallel), starts the tracer and syncs the ranks' clocks; explicit spans time
forward/backward/optimizer (attach(model=..., optimizer=...) would hook them instead: see
samples/ddp_loop.py); the comm wrappers record each collective's group, bytes and sequence number by
themselves; t.step() writes the step's row and starts the next. Read the result with
`megascope analyze RUN` or DuckDB: read_parquet('RUN/events/*/*.parquet').
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megascope import tracer
from megascope.tracer import comm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default="runs/plain-loop")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    with tracer.attach(args.run_dir) as t:                                 # trace
        for _ in range(args.steps):
            for mb in range(2):
                tracer.set_microbatch(mb)                                   # trace
                x = torch.randn(32, 64)
                with tracer.span("forward"):                                # trace
                    loss = (model(x) - x).pow(2).mean()
                with tracer.span("backward"):                               # trace
                    loss.backward()
            for param in model.parameters():  # data-parallel gradient average, traced by the wrapper
                grad = param.grad
                assert grad is not None  # every parameter took part in the backward
                comm.all_reduce(grad, dist.group.WORLD, "dp", name="grad_all_reduce")
                grad /= dist.get_world_size()  # in place: param.grad is this tensor
            with tracer.span("optimizer"):                                  # trace
                opt.step()
                opt.zero_grad()
            t.step(tokens=2 * 32, loss=loss.item())                         # trace
    dist.destroy_process_group()
    if rank == 0:
        print(f"trace written to {args.run_dir}")


if __name__ == "__main__":
    main()
