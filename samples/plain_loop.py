"""Tracing a plain PyTorch training loop with megascope.tracer (no megascope trainer needed).

    torchrun --nproc-per-node 2 samples/plain_loop.py --run-dir runs/plain     # or: python samples/plain_loop.py

The lines marked `# trace` are all it takes: spans around forward/backward/optimizer, the comm
wrappers for collectives (they record group, bytes and a sequence number by themselves), the ambient
step/micro-batch, a steps-table row per step, and a clock sync so ranks share one time base.
Read the result with `megascope analyze RUN` or DuckDB: read_parquet('RUN/events/*/*.parquet').
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megascope import tracer
from megascope.tracer import comm
from megascope.tracer.config import TraceConfig


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

    t = tracer.Tracer(args.run_dir, rank, TraceConfig(nvml=False), "cpu")  # trace
    tracer.activate(t)                                                      # trace
    t.sync_clocks()                                                         # trace (all ranks)
    for step in range(args.steps):
        tracer.set_step(step)                                               # trace
        for mb in range(2):
            tracer.set_microbatch(mb)                                       # trace
            x = torch.randn(32, 64)
            with tracer.span("forward"):                                    # trace
                loss = (model(x) - x).pow(2).mean()
            with tracer.span("backward"):                                   # trace
                loss.backward()
        for param in model.parameters():  # data-parallel gradient average, traced by the wrapper
            comm.all_reduce(param.grad, dist.group.WORLD, "dp", name="grad_all_reduce")
            param.grad /= dist.get_world_size()
        with tracer.span("optimizer", kind="host"):                         # trace
            opt.step()
            opt.zero_grad()
        tracer.record_step(tokens=2 * 32, loss=loss.item())                 # trace
    tracer.deactivate()                                                     # trace
    t.close()                                                               # trace
    dist.destroy_process_group()
    if rank == 0:
        print(f"trace written to {args.run_dir}")


if __name__ == "__main__":
    main()
