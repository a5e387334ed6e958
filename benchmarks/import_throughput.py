"""Import throughput: a large generated Kineto (torch.profiler) trace imported by `megascope import
kineto` in a fresh process; MB/s and peak RSS, side by side with `json.load` of the same file (what a
non-streaming importer would need just to parse it).

    python benchmarks/import_throughput.py [--mb 300] [--gpu] [--out /tmp/megascope-import-bench]

The trace imitates a CPU training loop as torch.profiler writes it: ProfilerStep#N annotations,
forward aten ops with nested children, autograd evaluate_function ops, an optimizer annotation,
c10d collectives on the main thread and gloo execution annotations on runloop threads. `--gpu` adds
what a CUDA profile holds: a `cudaLaunchKernel` runtime call per matmul and its kernel on a device
stream (written after the step's CPU ops, as Kineto writes buffers), joined into the kernels table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

MEASURE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
if sys.argv[1] == "json.load":
    import gzip
    opener = gzip.open if sys.argv[2].endswith(".gz") else open
    with opener(sys.argv[2], "rt") as f:
        n = len(json.load(f)["traceEvents"])
else:
    from megascope.tracer.importers.cli import import_run
    import_run("kineto", [sys.argv[2]], sys.argv[3])
elapsed = time.perf_counter() - t0
print(json.dumps({"s": elapsed, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _event(name: str, cat: str, ts: float, dur: float, tid: int, args: dict | None = None) -> str:
    return json.dumps({"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": round(ts, 3),
                       "dur": round(dur, 3), "args": args or {"External id": 1, "Ev Idx": 2}})


def _gpu(rows: list[str], gpu: list[str], t: float, corr: int, dur: float) -> None:
    """A kernel launch at t (host) and its kernel on stream 7 of device 0."""
    rows.append(json.dumps({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1,
                            "ts": round(t, 3), "dur": 4.0, "args": {"External id": corr, "cbid": 211,
                                                                    "correlation": corr}}))
    gpu.append(json.dumps({"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_tn", "pid": 0, "tid": 7,
                           "ts": round(t + 15, 3), "dur": dur, "args": {
                               "External id": corr, "queued": 0, "device": 0, "context": 1, "stream": 7,
                               "correlation": corr, "registers per thread": 128, "shared memory": 32768,
                               "grid": [64, 2, 1], "block": [256, 1, 1], "est. achieved occupancy %": 25}}))


def generate(path: Path, target_mb: float, with_gpu: bool = False, rank: int = 0, world: int = 1) -> int:
    """Write rank `rank`'s trace (of a data-parallel world of `world`) of about target_mb MB of JSON,
    gzip-compressed on the fly when `path` ends in .gz; streams (one step in memory); returns the number
    of events."""
    header = {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world,
              "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": world,
                             "ranks": list(range(world))}]},
              "baseTimeNanoseconds": 1790857026000000000, "displayTimeUnit": "ms"}
    n, ts, step = 0, 4_801_136_944_682.0, 0
    gz = str(path).endswith(".gz")
    with (gzip.open(path, "wt", compresslevel=1) if gz else open(path, "w")) as f:
        written = f.write("{\n" + ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in header.items())
                          + ',\n  "traceEvents": [\n')
        first = True
        corr = 0
        while written < target_mb * 1_000_000:
            rows, gpu, t = [], [], ts
            for _ in range(200):  # forward: an op with two nested children
                rows += [_event("aten::linear", "cpu_op", t, 30, 1), _event("aten::t", "cpu_op", t + 1, 3, 1),
                         _event("aten::addmm", "cpu_op", t + 5, 20, 1)]
                if with_gpu:
                    corr += 1
                    _gpu(rows, gpu, t + 8, corr, 18.0)
                t += 32
            for _ in range(200):  # backward
                rows += [_event("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", t, 50, 1),
                         _event("aten::mm", "cpu_op", t + 2, 40, 1)]
                if with_gpu:
                    corr += 1
                    _gpu(rows, gpu, t + 5, corr, 36.0)
                t += 52
            for i in range(8):  # gradient all-reduces and their gloo execution
                dims = {"Input Dims": [[[4096]], [], [], [], [], []], "Input type": ["TensorList"]}
                rows.append(_event("c10d::allreduce_", "cpu_op", t, 20, 1, dims))
                rows.append(_event("gloo:all_reduce", "user_annotation", t + 25, 300, 2 + i % 2,
                                   {"Input Dims": [[4096]], "Input type": ["float"]}))
                t += 330
            rows.append(_event("Optimizer.step#SGD.step", "user_annotation", t, 400, 1))
            t += 410
            rows.append(_event(f"ProfilerStep#{step}", "user_annotation", ts, t - ts, 1))
            rows += gpu
            written += f.write(("" if first else ",\n") + ",\n".join(rows))
            first = False
            n += len(rows)
            ts, step = t + 5, step + 1
        f.write('\n  ],\n  "traceName": "bench"\n}\n')
    return n


def measure(mode: str, src: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    result = subprocess.run([sys.executable, "-c", MEASURE, mode, str(src), str(out)],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=300, help="size of the generated JSON trace (MB)")
    p.add_argument("--gpu", action="store_true", help="add CUDA launches and kernels (a GPU profile)")
    p.add_argument("--out", default="/tmp/megascope-import-bench")
    args = p.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    src = root / "trace_rank0.json"
    t0 = time.perf_counter()
    events = generate(src, args.mb, args.gpu)
    gz = root / "trace_rank0.json.gz"
    with open(src, "rb") as f_in, gzip.open(gz, "wb", compresslevel=3) as f_out:
        shutil.copyfileobj(f_in, f_out)
    print(f"generated {events:,} events, {src.stat().st_size / 1e6:.0f} MB JSON "
          f"({gz.stat().st_size / 1e6:.0f} MB gzip) in {time.perf_counter() - t0:.0f} s\n")
    mb = src.stat().st_size / 1e6
    print("| input | reader | wall (s) | MB/s (uncompressed) | events/s | peak RSS (MB) |")
    print("|---|---|---|---|---|---|")
    for label, path in (("JSON", src), ("JSON.gz", gz)):
        for mode in ("megascope import", "json.load"):
            r = measure("import" if mode.startswith("megascope") else "json.load", path, root / "run")
            print(f"| {label} | {mode} | {r['s']:.1f} | {mb / r['s']:.1f} | {events / r['s']:,.0f} "
                  f"| {r['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
