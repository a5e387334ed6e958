"""An FSDP2 (torch.distributed.fsdp.fully_shard) training loop megascope did not write, traced by attaching.

    torchrun --nproc-per-node 2 samples/fsdp2_loop.py --run-dir runs/fsdp2
    megascope analyze runs/fsdp2

Each linear layer and the root are sharded with fully_shard; FSDP2 all-gathers each layer's
parameters before its forward and backward and reduce-scatters its gradients, through
torch.distributed.all_gather_single / reduce_scatter_single, which attach's interception records
(group dp, seq, bytes) without any change to FSDP. The lines marked `# megascope` are all the tracing.
Runs on CPU with gloo (torch 2.13: FSDP2 issues synchronous collectives there) and on GPUs with NCCL.
`--slow-rank R --slow-ms MS` sleeps MS in rank R's forward from step `--slow-from` on.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from megascope import tracer
from megascope.samples.ddp_loop import Mlp, parse_args


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Mlp(args.width, args.depth)
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))
               for _ in range(args.steps)]

    with tracer.attach(args.run_dir, model=model, optimizer=opt) as t:                    # megascope
        for step, (x, y) in enumerate(t.data(batches)):                                    # megascope
            model.sleep_s = args.slow_ms / 1e3 if rank == args.slow_rank and step >= args.slow_from else 0.0
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t.step(tokens=len(x), loss=loss.item())                                        # megascope


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, "runs/fsdp2-loop", __doc__.splitlines()[0])
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    dist.init_process_group("gloo")
    train(args)
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(f"trace written to {args.run_dir}; read it with: megascope analyze {args.run_dir}")


if __name__ == "__main__":
    main()
