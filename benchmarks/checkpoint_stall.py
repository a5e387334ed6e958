"""Checkpoint cost on this machine: the training stall per save of the two checkpoint formats side by
side, the two-stage snapshot (host copy, background torch.save of one file per shard) and DCP
(torch.distributed.checkpoint: the same host copy into reused buffers, then dcp.async_save; reshardable
across dp, to a path or an fsspec URL), with a plain synchronous torch.save of the same state as the
baseline; then the time from a failure to resumed training through the real `megascope train` (crash
injection, elastic restart, checkpoint resume; the default format).

    python benchmarks/checkpoint_stall.py [--preset small] [--saves 4] [--no-recovery]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, port: int, preset: str, run_dir: str, mode: str, saves: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megascope.trainer.config import JobConfig, apply_overrides
    from megascope.trainer.data import build_loader
    from megascope.trainer.lr_schedule import learning_rate
    from megascope.trainer.parallel.parallel_dims import ParallelDims
    from megascope.trainer.parallel.parallelize import parallelize
    from megascope.trainer.presets import preset as get_preset
    from megascope.trainer.robust.checkpoint import CheckpointManager
    from megascope.trainer.robust.faults import Faults
    from megascope.trainer.step import train_step

    cfg = JobConfig()
    apply_overrides(cfg, get_preset(preset), "preset")
    cfg.parallel.dp, cfg.run_dir, cfg.trace.enabled = world, run_dir, False
    dims = ParallelDims(world, 1, 1)
    dims.build_groups()
    state = parallelize(cfg, dims, torch.device("cpu"), Faults([], rank))
    if mode == "dcp":
        from megascope.trainer.robust.checkpoint_dcp import DcpCheckpointManager

        manager = DcpCheckpointManager(cfg, dims, rank, torch.device("cpu"))
    else:
        manager = CheckpointManager(cfg, dims, rank, torch.device("cpu"), mode=mode)
    loader = build_loader(cfg, dims, rank, torch.device("cpu"))
    step_s, every = [], 2
    try:
        for step in range(every * saves):
            t0 = time.perf_counter()
            batch, _ = loader.next()
            train_step(state, batch, learning_rate(cfg.train, step))
            step_s.append(time.perf_counter() - t0)
            if (step + 1) % every == 0:
                manager.save(step + 1, state)
        manager.close()
    finally:
        loader.close()
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state.optimizer.state_dict()))
    queue.put((rank, manager.stalls_s, manager.write_s, statistics.median(step_s), nbytes))
    dist.destroy_process_group()


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


def measure_stall(preset: str, mode: str, saves: int, world: int = 2) -> dict:
    from megascope.trainer.launch import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as run_dir:
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, preset, run_dir, mode, saves, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=600) for _ in range(world)]
        for p in procs:
            p.join()
    stalls = [s for _, st, _, _, _ in results for s in st]
    writes = [w for _, _, wr, _, _ in results for w in wr]
    return {"mode": mode, "stall_ms": 1e3 * statistics.median(stalls), "stall_max_ms": 1e3 * max(stalls),
            "write_ms": 1e3 * statistics.median(writes), "step_ms": 1e3 * statistics.median(r[3] for r in results),
            "mb_per_rank": results[0][4] / 2**20}


def measure_recovery() -> list[dict]:
    from megascope.analyzer.views.incidents import read_incidents, recovery_times

    rows = []
    for fault in ("crash:rank=1,at=5", "hang:rank=2,at=5"):
        with tempfile.TemporaryDirectory() as run_dir:
            cmd = [sys.executable, "-m", "megascope.cli", "train", "--preset", "tiny", "--dp", "2", "--pp", "2",
                   "--steps", "8", "--run-dir", run_dir, "--max-restarts", "1", "--inject", fault,
                   "--set", "robust.checkpoint_every=2", "--set", "trace.hang_timeout_s=2",
                   "--set", "robust.stall_timeout_s=5"]
            t0 = time.monotonic()
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            total = time.monotonic() - t0
            if result.returncode != 0:
                raise RuntimeError(f"{fault}: megascope train failed:\n{result.stderr[-2000:]}")
            df = read_incidents(run_dir)
            rec = recovery_times(df).iloc[0]
            restart = df[df.kind == "restart"].time.iloc[0]
            failure = df[df.kind.isin(["dead_rank", "stall"])].time.iloc[0]
            rows.append({"fault": fault, "detected_as": rec.failure, "detect_to_restart_s": restart - failure,
                         "detect_to_resumed_s": rec.recovery_s, "job_total_s": total})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--no-recovery", action="store_true", help="only the stall table")
    args = parser.parse_args()
    print(f"## Training stall per checkpoint ({args.preset} preset, dp=2 ZeRO, gloo on CPU; "
          "median over ranks x saves)\n")
    print("| save | state per rank (MiB) | stall median (ms) | stall max (ms) | persist (ms) | step (ms) |")
    print("|---|---|---|---|---|---|")
    names = {"async": "snapshot: two-stage (host copy + background torch.save)",
             "dcp": "dcp: host copy + dcp.async_save (reshardable)",
             "sync": "baseline: plain synchronous torch.save"}
    for mode in ("async", "dcp", "sync"):
        r = measure_stall(args.preset, mode, args.saves)
        print(f"| {names[mode]} | {r['mb_per_rank']:.1f} | {r['stall_ms']:.1f} | {r['stall_max_ms']:.1f} | "
              f"{r['write_ms']:.1f} | {r['step_ms']:.1f} |")
    if args.no_recovery:
        return
    print("\n## Failure to resumed training (tiny preset, dp=2 pp=2, checkpoint every 2 steps, one elastic restart)\n")
    print("| fault | detected as | detection -> restarted group (s) | detection -> first resumed step done (s) "
          "| whole job (s) |")
    print("|---|---|---|---|---|")
    for r in measure_recovery():
        print(f"| `{r['fault']}` | {r['detected_as']} | {r['detect_to_restart_s']:.1f} | "
              f"{r['detect_to_resumed_s']:.1f} | {r['job_total_s']:.1f} |")


if __name__ == "__main__":
    main()
