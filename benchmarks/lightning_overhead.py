"""Overhead of megascope's Lightning callback on samples/lightning_loop.py's job: fits with and without
it, interleaved, in the same 2 gloo ranks under torchrun.

    python benchmarks/lightning_overhead.py [--rounds 12] [--steps 40] [--width 384 --depth 4 --batch 256]

Lightning owns the loop, so blocks are whole `Trainer.fit` calls of `steps` steps on the same model
and batches (Lightning's DDP strategy, gloo on CPU): "off" is plain Lightning, "on" adds
MegascopeCallback (attach: module hooks, DDP communication hook, interception of torch.distributed,
the tracer's threads, the summary line). Each round runs an off fit and an on fit, order alternating,
so slow drifts of a shared machine's load cancel. A step's time is the wall time between consecutive
`on_train_batch_end` calls of rank 0 (a timing callback, in both modes), the first 3 steps of a fit
(DDP's first buckets, warm-up) left out; the training thread's CPU likewise. Prints on/off as the
ratio of the means over all rounds with a 95% bootstrap interval over rounds and the median of
per-round ratios (benchmarks/tracer_overhead.py's method).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 3
"""Leading steps of each fit left out (DDP's bucket rebuild on the first step, warm-up)."""


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from megascope.samples.lightning_loop import Regressor
    from megascope.tracer.lightning_callback import MegascopeCallback

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.thread: list[float] = []
            self._last: tuple[float, float] | None = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = (time.perf_counter(), time.thread_time())
            if self._last is not None and batch_idx > SKIP:
                self.wall.append(now[0] - self._last[0])
                self.thread.append(now[1] - self._last[1])
            self._last = now

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = Regressor(args.width, args.depth, {"rank": -1, "s": 0.0, "from": 0})
    g = torch.Generator().manual_seed(1)
    n = args.steps * args.batch * world
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, 1, generator=g))
    rounds: list[dict[str, list[float]]] = []
    for rnd in range(args.rounds):
        rounds.append({})
        for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            timer = Timer()
            callbacks: list[pl.Callback] = [timer]
            if mode == "on":
                callbacks.append(MegascopeCallback(Path(args.out).parent / f"run-{rnd}"))
            trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=args.steps, max_epochs=1,
                                 strategy=DDPStrategy(process_group_backend="gloo"), callbacks=callbacks,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, num_sanity_val_steps=0)
            trainer.fit(model, DataLoader(data, batch_size=args.batch))
            rounds[-1][mode], rounds[-1]["thread_" + mode] = timer.wall, timer.thread
    if int(os.environ["RANK"]) == 0:
        Path(args.out).write_text(json.dumps(rounds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="interleaved off/on pairs of fits")
    p.add_argument("--steps", type=int, default=40, help="steps per fit")
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rounds.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--worker", "--out", str(out), "--rounds", str(args.rounds), "--steps", str(args.steps),
               "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
        # TMPDIR: torchrun's /tmp/torchelastic_* folder lands in ours and goes with it (torch never removes it)
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TMPDIR": tmp})
        if done.returncode != 0:
            sys.exit(f"lightning_overhead: the job failed:\n{done.stderr[-3000:]}")
        rounds = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT))
    from benchmarks.tracer_overhead import paired_ratio

    print(f"job: samples/lightning_loop.py's model (width {args.width}, depth {args.depth}, batch {args.batch}), "
          f"Lightning DDP strategy on 2 gloo ranks; {args.rounds} rounds x one fit of {args.steps} steps per mode "
          f"(first {SKIP} left out), interleaved; rank 0")
    print("| statistic | off (ms) | on (ms) | on/off (95% CI) | overhead % | median of per-round ratios |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, key in (("step time (wall)", ""), ("training thread CPU", "thread_")):
        s = paired_ratio(rounds, key)
        print(f"| {label} | {s.off * 1e3:.2f} | {s.on * 1e3:.2f} | {s.ratio:.4f} ({s.low:.4f}-{s.high:.4f}) | "
              f"{(s.ratio - 1) * 100:+.2f} | {s.median:.4f} |")


if __name__ == "__main__":
    main()
