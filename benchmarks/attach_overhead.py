"""Overhead of megascope.tracer.attach on the DDP sample: the same job with and without it, interleaved.

    python benchmarks/attach_overhead.py [--rounds 200] [--steps 2] [--width 384 --depth 4 --batch 256]

Two DistributedDataParallel copies of samples/ddp_loop.py's model (same weights, same batches) live in
the same 2 gloo ranks: "off" is plain DDP (C++ all-reduce, no hooks), "on" is attached (its DDP
communication hook, forward/backward/optimizer hooks, data-wait span, t.step(), interception of
torch.distributed installed, the tracer's threads running). Each round runs an off block and an on
block of `steps` steps back to back (order alternating), so slow drifts of a shared machine's load
cancel; the tracer's threads run during both. Prints, for rank 0, step time, training-thread CPU and
process CPU as on/off = ratio of the means over all rounds with a 95% bootstrap interval over rounds
and the median of per-round ratios (benchmarks/tracer_overhead.py's method), and events per step.
`--variant python-hook` measures the reference: "on" is DDP with torch's own default all-reduce hook
(a Python communication hook, as attach's) and no megascope.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for benchmarks.tracer_overhead

from benchmarks.tracer_overhead import paired_ratio  # noqa: E402
from megascope import tracer  # noqa: E402
from megascope.samples.ddp_loop import Mlp  # noqa: E402
from megascope.samples.distributed import run_distributed  # noqa: E402
from megascope.tracer.config import TraceConfig  # noqa: E402


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def job(rank: int, world: int, args: argparse.Namespace, run_dir: str) -> dict:
    torch.manual_seed(0)
    net = Mlp(args.width, args.depth)
    off, on = DistributedDataParallel(net), DistributedDataParallel(copy.deepcopy(net))
    opt_off = torch.optim.AdamW(off.parameters(), lr=1e-3)
    opt_on = torch.optim.AdamW(on.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    batch = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))]
    for _ in range(args.warmup):
        _step(off, opt_off, *batch[0])
    rounds: list[dict[str, list[float]]] = []
    if args.variant == "python-hook":  # reference: DDP's own default hook, in Python, no megascope
        on.register_comm_hook(None, allreduce_hook)
    with _attached(args.variant, run_dir, on, opt_on) as t:
        for _ in range(args.warmup):
            for x, y in t.data(batch):
                t.step(loss=_step(on, opt_on, x, y))
        for rnd in range(args.rounds):
            rounds.append({key + mode: [] for key in ("", "cpu_", "thread_") for mode in ("off", "on")})
            for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                for _ in range(args.steps):
                    dist.barrier()
                    start, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
                    if mode == "on":
                        for x, y in t.data(batch):
                            t.step(tokens=len(x), loss=_step(on, opt_on, x, y))
                    else:
                        for x, y in batch:
                            _step(off, opt_off, x, y)
                    rounds[-1][mode].append(time.perf_counter() - start)
                    rounds[-1]["cpu_" + mode].append(time.process_time() - cpu)
                    rounds[-1]["thread_" + mode].append(time.thread_time() - thread)
    events = sum(1 for _ in _rows(run_dir, rank))
    return {"rounds": rounds, "events": events, "on_steps": t.current_step}


class _Untraced:
    """Stands in for an Attachment (variant python-hook): data() and step() do nothing extra."""

    current_step = 0

    def __enter__(self) -> "_Untraced":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def data(self, batch: list) -> list:
        return batch

    def step(self, **kwargs: object) -> None:
        self.current_step += 1


def _attached(variant: str, run_dir: str, model: torch.nn.Module, opt: torch.optim.Optimizer):
    if variant == "python-hook":
        return _Untraced()
    return tracer.attach(run_dir, model=model, optimizer=opt, config=TraceConfig(nvml=False))


def _rows(run_dir: str, rank: int):
    import pyarrow.parquet as pq

    for seg in sorted((Path(run_dir) / "events" / f"rank={rank:05d}").glob("seg-*.parquet")):
        yield from range(pq.read_metadata(seg).num_rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200, help="interleaved off/on pairs")
    p.add_argument("--steps", type=int, default=2, help="steps per block")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--variant", choices=["attach", "python-hook"], default="attach",
                   help="on = attached (default), or DDP with torch's default Python all-reduce hook and no "
                        "megascope (the cost of a Python communication hook alone)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_distributed(job, 2, args, str(Path(tmp) / "run"), timeout=3600)[0]
    rounds = result["rounds"]
    per_step = result["events"] / max(result["on_steps"], 1)
    print(f"job: samples/ddp_loop.py's model (width {args.width}, depth {args.depth}, batch {args.batch}), "
          f"DDP on 2 gloo ranks; on = {args.variant}; {args.rounds} rounds x {args.steps} steps per mode, "
          "interleaved; rank 0; "
          f"{per_step:.1f} events/step")
    print("| statistic | off (ms) | on (ms) | on/off (95% CI) | overhead % | median of per-round ratios |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, key in (("step time (wall)", ""), ("training thread CPU", "thread_"),
                       ("process CPU (all threads)", "cpu_")):
        s = paired_ratio(rounds, key)
        print(f"| {label} | {s.off * 1e3:.2f} | {s.on * 1e3:.2f} | {s.ratio:.4f} ({s.low:.4f}-{s.high:.4f}) | "
              f"{(s.ratio - 1) * 100:+.2f} | {s.median:.4f} |")


if __name__ == "__main__":
    main()
