"""Tokens/s of megascope's data parallelism against torch's DistributedDataParallel, side by side.

Both run the same GPT (trainer/modeling/model.py), the same batches, AdamW and clipping on a real gloo group of
`--dp` processes; rounds alternate megascope / DDP so machine noise hits both alike. Prints a table:

    python benchmarks/ddp_compare.py [--preset tiny] [--dp 2] [--steps 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megascope.samples.distributed import run_distributed
from megascope.trainer.config import JobConfig, apply_overrides, micro_batches
from megascope.trainer.modeling.model import GPT
from megascope.trainer.parallel.parallel_dims import ParallelDims
from megascope.trainer.presets import preset
from megascope.trainer.robust.faults import Faults


def make_config(args: argparse.Namespace, zero: bool) -> JobConfig:
    cfg = JobConfig()
    apply_overrides(cfg, preset(args.preset), source="preset")
    cfg.parallel.dp, cfg.parallel.zero = args.dp, zero
    cfg.trace.enabled = False
    return cfg


def batches(cfg: JobConfig, dp_rank: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.train.seed)
    m, b, s = micro_batches(cfg), cfg.train.micro_batch, cfg.model.seq_len
    full = [torch.randint(0, cfg.model.vocab_size, (cfg.parallel.dp, m, b, s + 1), generator=g)
            for _ in range(steps)]
    return [x[dp_rank] for x in full]


def megascope_job(rank: int, world: int, args: argparse.Namespace, zero: bool) -> list[float]:
    from megascope.trainer.parallel.parallelize import parallelize
    from megascope.trainer.step import train_step

    cfg = make_config(args, zero)
    dims = ParallelDims(world, 1, 1)
    dims.build_groups()
    state = parallelize(cfg, dims, torch.device("cpu"), Faults([], rank))
    times = []
    for batch in batches(cfg, rank, args.steps):
        t0 = time.perf_counter()
        train_step(state, batch, cfg.train.lr)
        times.append(time.perf_counter() - t0)
    return times


def ddp_job(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = make_config(args, zero=False)
    torch.manual_seed(cfg.train.seed)
    model = DDP(GPT(cfg.model), bucket_cap_mb=cfg.parallel.bucket_mb)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    times = []
    for batch in batches(cfg, rank, args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i, micro in enumerate(batch):
            last = i == len(batch) - 1
            ctx = model.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                logits = model(micro[:, :-1])
                loss = model.module.loss(logits, micro[:, 1:]) / len(batch)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        dist.barrier()  # megascope's step ends with a collective too (loss, norm), keep them alike
        times.append(time.perf_counter() - t0)
    return times


def steady(per_rank: list[list[float]]) -> float:
    """Median over steps after warm-up of the slowest rank's step time."""
    slowest = [max(ts) for ts in zip(*per_rank)]
    return statistics.median(slowest[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = make_config(args, True)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    results: dict[str, list[float]] = {"megascope zero-2": [], "megascope all-reduce": [], "torch DDP": []}
    for r in range(args.rounds):
        results["megascope zero-2"].append(steady(run_distributed(megascope_job, args.dp, args, True)))
        results["megascope all-reduce"].append(steady(run_distributed(megascope_job, args.dp, args, False)))
        results["torch DDP"].append(steady(run_distributed(ddp_job, args.dp, args)))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    ddp = statistics.median(results["torch DDP"])
    print(f"\npreset {args.preset}, dp={args.dp}, gloo, one CPU thread per rank, "
          f"{args.steps} steps x {args.rounds} rounds (median of rounds)\n")
    print(f"| {'implementation':22} | step time (s) | tokens/s | vs DDP |")
    print(f"|{'-' * 24}|---------------|----------|--------|")
    for name, values in results.items():
        t = statistics.median(values)
        print(f"| {name:22} | {t:13.4f} | {tokens / t:8.0f} | {ddp / t:5.2f}x |")


if __name__ == "__main__":
    main()
