"""Rank 0's console output: one line per step and a summary at the end."""

from __future__ import annotations

import math
import statistics

from megascope.tracer.run_dir import read_manifest
from megascope.trainer.config import JobConfig
from megascope.trainer.modeling.flops import model_flops_per_step
from megascope.trainer.parallel.parallel_dims import ParallelDims


class StepLog:
    def __init__(self, cfg: JobConfig, dims: ParallelDims) -> None:
        self.cfg = cfg
        self.world = dims.world_size
        self.tokens = cfg.train.global_batch * cfg.model.seq_len
        self.flops = model_flops_per_step(cfg.model, cfg.train.global_batch)
        self.peak = read_manifest(cfg.run_dir)["peak_flops"]["per_device"]
        self.times: list[float] = []
        self.losses: list[float] = []

    def mfu(self, seconds: float) -> float:
        return self.flops / (seconds * self.world * self.peak)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, seconds: float) -> None:
        self.times.append(seconds)
        self.losses.append(loss)
        print(f"step {step:5d} | loss {loss:7.4f} | lr {lr:.2e} | grad_norm {grad_norm:6.3f} | "
              f"tokens/s {self.tokens / seconds:9.0f} | step_time(s) {seconds:6.3f} | "
              f"mfu(%) {100 * self.mfu(seconds):5.2f}", flush=True)

    def summary(self) -> None:
        if not self.times:
            return
        steady = self.times[1:] or self.times  # the first step pays for warm-up
        median = statistics.median(steady)
        first = next((x for x in self.losses if not math.isnan(x)), math.nan)
        print(f"done: {len(self.times)} steps | loss {first:.4f} -> {self.losses[-1]:.4f} | "
              f"median step_time(s) {median:.3f} | tokens/s {self.tokens / median:.0f} | "
              f"mfu(%) {100 * self.mfu(median):.2f} | trace: {self.cfg.run_dir}", flush=True)
