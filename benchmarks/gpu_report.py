"""The GPU round's tables from traced run directories: MFU (the analyzer's MFU timeline, cross-checked
against the FLOPs formula), the step-time breakdown, and each run's findings.

    python benchmarks/gpu_report.py RUN [RUN ...] [--skip 3]

MFU and HFU are means over the steps after the first `--skip` (compilation, allocator warm-up):
the analyzer's timeline (model FLOPs / (step time x world x peak)) beside the same from the steps
table's median step time and docs/model.md's formula (trainer/modeling/flops.py). The device table
gives NVML's view of the same steps (the SM clock the power cap allows) and, where `trace.cupti` was
on, CUPTI's kernel records per step (what its cost is divided by).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascope.analyzer import Run  # noqa: E402
from megascope.trainer.config import JobConfig  # noqa: E402
from megascope.trainer.modeling.flops import (  # noqa: E402
    hardware_flops_per_step,
    model_flops_per_step,
    parameter_count,
)


def measured(run: Run, skip: int) -> tuple[int, int]:
    steps = sorted(run.steps().step.unique())
    if len(steps) <= skip:
        raise SystemExit(f"gpu_report: {run.path} has {len(steps)} steps; need more than --skip {skip}")
    return int(steps[skip]), int(steps[-1])


def mfu_row(path: str, skip: int) -> str:
    run = Run.open(path)
    cfg = JobConfig.from_dict(run.manifest["config"])
    m, t, p = cfg.model, cfg.train, cfg.parallel
    first, last = measured(run, skip)
    timeline = run.mfu().per_step
    timeline = timeline[timeline.step.between(first, last)]
    steps = run.steps()
    per_step = steps[steps.step.between(first, last)].groupby("step")
    step_s = statistics.median(((g.end_ns.max() - g.start_ns.min()) / 1e9) for _, g in per_step)
    world = p.dp * p.tp * p.pp
    peak = float(run.manifest["peak_flops"]["per_device"]) * world
    formula_mfu = model_flops_per_step(m, t.global_batch) / step_s / peak
    hfu = hardware_flops_per_step(m, t.global_batch, p.recompute) / step_s / peak
    attention = f"window {m.window}" if m.window else f"causal attention (SDPA {t.attention_backend})"
    ran = ", ".join(filter(None, [t.dtype, "compiled blocks" if t.compile else "eager",
                                  "compiled loss" if t.compile_loss else "", attention,
                                  f"recompute {p.recompute}" if p.recompute != "none" else "",
                                  f"dp{p.dp} tp{p.tp} pp{p.pp}"]))
    return (f"| {Path(path).name} | {parameter_count(m) / 1e9:.2f}B (L{m.n_layers} h{m.hidden} a{m.n_heads} "
            f"V{m.vocab_size}) | {m.seq_len} | {t.global_batch} x {t.micro_batch} | "
            f"{timeline.tokens_per_s.mean():,.0f} | {step_s:.3f} | {timeline.mfu.mean() * 100:.1f}% | "
            f"{formula_mfu * 100:.1f}% | {hfu * 100:.1f}% | {ran} | {first}-{last} |")


def breakdown_row(path: str, skip: int) -> str:
    run = Run.open(path)
    first, last = measured(run, skip)
    parts = run.breakdown((first, last)).mean(numeric_only=True)
    events = run.events((first, last), limit=2_000_000)
    optimizer = events[events.name == "optimizer"]
    n = last - first + 1
    optimizer_s = float((optimizer.end_ns - optimizer.start_ns).sum()) / 1e9 / n / max(run.topology.shape[0], 1)
    total = float(parts[["compute_s", "exposed_comm_s", "bubble_s", "data_wait_s", "other_s"]].sum())
    cells = [parts.compute_s - optimizer_s, optimizer_s, parts.exposed_comm_s, parts.bubble_s,
             parts.data_wait_s, parts.other_s]
    return (f"| {Path(path).name} | {total * 1e3:.1f} | "
            + " | ".join(f"{c * 1e3:.1f} ({c / total * 100:.1f}%)" for c in cells) + " |")


def device_row(path: str, skip: int) -> str:
    run = Run.open(path)
    first, last = measured(run, skip)
    steps = run.steps()
    steps = steps[steps.step.between(first, last)]
    window = {"lo": int(steps.start_ns.min()), "hi": int(steps.end_ns.max())}
    gpu = run.gpu()
    gpu = gpu[gpu.ts_ns.between(window["lo"], window["hi"])]
    kernels = run.store.query("SELECT count(*) AS n FROM kernels WHERE start_ns BETWEEN $lo AND $hi", window)
    per_step = int(kernels.n.iloc[0]) / (last - first + 1)
    if gpu.empty:
        return f"| {Path(path).name} | {per_step:,.0f} | - | - | - | - | - |"
    reasons = gpu.throttle_reasons.mode()
    return (f"| {Path(path).name} | {per_step:,.0f} | {gpu.sm_clock_mhz.median():,.0f} | {gpu.power_w.median():.0f} "
            f"| {gpu.gpu_util.median():.1f} | {gpu.mem_used_bytes.max() / 1e9:.1f} | "
            f"{int(reasons.iloc[0]) if len(reasons) else '-'} |")


def findings(path: str) -> list[str]:
    found = Run.open(path).findings()
    if not found:
        return [f"- {Path(path).name}: no findings"]
    return [f"- {Path(path).name}: {f.kind} ranks {f.ranks} steps {f.steps[0]}-{f.steps[1]} "
            f"(x{f.severity:.2f}): {f.summary}" for f in found]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", help="traced run directories")
    p.add_argument("--skip", type=int, default=3, help="first steps left out (compilation, warm-up)")
    args = p.parse_args()
    for path in args.runs:
        if not (Path(path) / "run.json").is_file():
            sys.exit(f"gpu_report: {path} is not a megascope run directory (no run.json)")
    print("| run | model | seq | global x micro batch | tokens/s | step (s) | MFU (analyzer) | MFU (formula) "
          "| HFU | what ran | steps |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for path in args.runs:
        print(mfu_row(path, args.skip))
    print("\nStep-time breakdown (ms per step, mean over ranks and the measured steps):")
    print("| run | step | compute (fwd+bwd) | optimizer | exposed comm | bubble | data wait | other |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.runs:
        print(breakdown_row(path, args.skip))
    print("\nDevice over the measured steps (NVML medians, peak memory; CUPTI kernel records per step):")
    print("| run | kernels/step (CUPTI) | SM clock (MHz) | power (W) | GPU util (%) | peak memory (GB) "
          "| throttle reasons (NVML mask, mode) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.runs:
        print(device_row(path, args.skip))
    print("\nFindings (megascope analyze):")
    for path in args.runs:
        print("\n".join(findings(path)))


if __name__ == "__main__":
    main()
