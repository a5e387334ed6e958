"""Kineto GPU activity -> the kernels table, on synthetic traces laid out like torch.profiler's with CUDA
activity (no GPU here): kernels, memcpy and memset on device streams, each joined to its launching
runtime call through the correlation id wherever the two sit in the file, on the run's clock."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from megascope.analyzer import Run
from megascope.tracer.importers import kineto_gpu, spool
from megascope.tracer.importers.cli import import_run
from megascope.tracer.importers.comm_kernels import comm_kernel

BASE_NS = 1_790_857_026_000_000_000
PID, TID, STREAM, COPY_STREAM = 2451, 2451, 7, 20
STEPS, LAYERS = 3, 4


def gpu_trace(rank: int, world: int = 2) -> tuple[dict, list[dict]]:
    """A torch.profiler-shaped trace with CUDA activity, and the GPU activities it holds (expected rows).

    Layout as Kineto writes it: metadata first, CPU ops and runtime calls (cpu_op, cuda_runtime with
    `cbid` and `correlation`, user annotations), then the GPU activity in buffer order (kernel,
    gpu_memcpy, gpu_memset on pid = device, tid = stream, with `correlation` and `External id`), then
    `ac2g` flow events and process/thread metadata. Also: a CUDA graph (two kernels of one launch),
    a sync call with a correlation id that launches nothing, a kernel written before its launch, and
    one kernel whose launch precedes the profiling window.
    """
    cpu, gpu, flows, expected = [], [], [], []
    t, corr, ext = 4_801_136_944_682.413, 1000, 500

    def launch(name: str, cat: str, gpu_name: str, dur_us: float, stream: int, cbid: int, extra=None,
               count: int = 1) -> None:
        nonlocal corr, ext, t
        corr += 1
        ext += 1
        cpu.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": PID, "tid": TID, "ts": t,
                    "dur": 12.0, "args": {"External id": ext, "Record function id": 0, "Ev Idx": ext,
                                          "Input Dims": [[64, 64], [64, 64]], "Input type": ["float", "float"]}})
        launch_ts = round(t + 3.251, 3)
        cpu.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": PID, "tid": TID, "ts": launch_ts,
                    "dur": 4.5, "args": {"External id": ext, "cbid": cbid, "correlation": corr}})
        g = launch_ts + 20.0
        for _ in range(count):
            args = {"External id": ext, "queued": 0, "device": rank, "context": 1, "stream": stream,
                    "correlation": corr, **(extra or {})}
            gpu.append({"ph": "X", "cat": cat, "name": gpu_name, "pid": rank, "tid": stream, "ts": round(g, 3),
                        "dur": dur_us, "args": args})
            expected.append({"name": gpu_name, "correlation": corr, "stream": stream, "ts": round(g, 3),
                             "dur": dur_us, "launch_ts": launch_ts, "kind": kineto_gpu.GPU_CATS[cat],
                             "bytes": int((extra or {}).get("bytes", 0))})
            g += dur_us + 1.0
        flows.append({"ph": "s", "id": corr, "pid": PID, "tid": TID, "ts": launch_ts, "cat": "ac2g", "name": "ac2g"})
        flows.append({"ph": "f", "id": corr, "pid": rank, "tid": stream, "ts": round(launch_ts + 20, 3),
                      "cat": "ac2g", "name": "ac2g", "bp": "e"})
        t += 40.0

    # a kernel launched before the profiler's active window: no runtime call in the trace
    gpu.append({"ph": "X", "cat": "kernel", "name": "void early_kernel<float>()", "pid": rank, "tid": STREAM,
                "ts": t - 30.0, "dur": 5.0, "args": {"device": rank, "stream": STREAM, "correlation": 77}})
    expected.append({"name": "void early_kernel<float>()", "correlation": 77, "stream": STREAM, "ts": t - 30.0,
                     "dur": 5.0, "launch_ts": None, "kind": "kernel", "bytes": 0})
    for step in range(STEPS):
        step_start = t
        cpu.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": PID, "tid": TID,
                    "ts": step_start, "dur": 0.0, "args": {"External id": 1, "Record function id": 0}})
        step_event = cpu[-1]
        t += 1.0
        launch("cudaMemcpyAsync", "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 8.0, COPY_STREAM, 41,
               {"bytes": 65536, "memory bandwidth (GB/s)": 8.2})
        for layer in range(LAYERS):
            launch("cudaLaunchKernel", "kernel", "ampere_sgemm_64x64_nn", 30.0 + layer, STREAM, 211,
                   {"registers per thread": 122, "shared memory": 16384, "blocks per SM": 0.25,
                    "warps per SM": 1.0, "grid": [16, 1, 1], "block": [128, 1, 1],
                    "est. achieved occupancy %": 6})
        launch("cudaMemsetAsync", "gpu_memset", "Memset (Device)", 1.5, STREAM, 51, {"bytes": 4096})
        launch("cudaGraphLaunch", "kernel", "void graph_node_kernel<float>()", 6.0, STREAM, 311, count=2)
        corr += 1  # a sync: a correlation id but no GPU activity
        cpu.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": PID, "tid": TID,
                    "ts": t, "dur": 90.0, "args": {"cbid": 131, "correlation": corr}})
        t += 100.0
        step_event["dur"] = round(t - step_start, 3)
    # one kernel written before its launch (buffer order is not launch order)
    gpu.insert(0, gpu.pop())
    trace = {
        "schemaVersion": 1,
        "deviceProperties": [{"id": rank, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85029158912,
                              "computeMajor": 9, "computeMinor": 0, "maxThreadsPerBlock": 1024,
                              "numSms": 132, "regsPerBlock": 65536, "sharedMemPerBlock": 49152}],
        "cupti_version": 24, "cuda_runtime_version": 12040, "cuda_driver_version": 12040,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1,
                            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                                           "pg_size": world, "ranks": list(range(world))}],
                            "nccl_version": "2.21.5"},
        "record_shapes": 1,
        "traceEvents": cpu + gpu + flows + [
            {"name": "process_name", "ph": "M", "ts": 0, "pid": PID, "tid": 0, "args": {"name": "python"}},
            {"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"name": f"GPU {rank}"}},
            {"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": STREAM,
             "args": {"name": f"stream {STREAM}"}},
        ],
        "traceName": f"trace_rank{rank}.json", "displayTimeUnit": "ms", "baseTimeNanoseconds": BASE_NS,
    }
    return trace, expected


def _write(path: Path, trace: dict) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump(trace, f)
    return path


def _kernels(run_dir: Path) -> pd.DataFrame:
    import duckdb

    return duckdb.sql(f"SELECT * FROM read_parquet('{run_dir}/kernels/rank=*/*.parquet', hive_partitioning=false)").df()


@pytest.fixture
def spool_root(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "spool"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.mark.parametrize("spool_rows", [3, 131_072], ids=["many-spool-files", "one-spool-file"])
def test_gpu_activity_lands_in_kernels_with_its_launch(tmp_path: Path, spool_root: Path, monkeypatch, spool_rows):
    monkeypatch.setattr(spool, "SPOOL_ROWS", spool_rows)
    expected = {}
    paths = []
    for rank in (0, 1):
        trace, expected[rank] = gpu_trace(rank)
        paths.append(_write(tmp_path / f"trace_rank{rank}.json{'.gz' if rank else ''}", trace))
    result = import_run("kineto", paths, tmp_path / "run")
    got = _kernels(tmp_path / "run")
    for rank in (0, 1):
        rows = got[got["rank"] == rank].sort_values(["start_ns", "name"]).reset_index(drop=True)
        exp = pd.DataFrame(expected[rank]).sort_values(["ts", "name"]).reset_index(drop=True)
        assert len(rows) == len(exp) == 1 + STEPS * (LAYERS + 4)
        assert rows.name.tolist() == exp.name.tolist()
        assert rows.start_ns.tolist() == [BASE_NS + round(ts * 1000) for ts in exp.ts]  # exact, on the run's clock
        assert (rows.end_ns - rows.start_ns).tolist() == [round(d * 1000) for d in exp.dur]
        assert rows.launch_ns.tolist() == [BASE_NS + round(ts * 1000) if ts == ts and ts is not None else -1
                                           for ts in exp.launch_ts]
        assert rows.correlation.tolist() == exp.correlation.tolist()
        assert rows.stream.tolist() == exp.stream.tolist() and set(rows.device) == {rank}
        assert rows.kind.tolist() == exp.kind.tolist() and rows.bytes.tolist() == exp.bytes.tolist()
        # the step of the launch; the early kernel is outside every ProfilerStep
        assert sorted(rows.step.unique().tolist()) == [-1, *range(STEPS)]
        assert (rows.step == -1).sum() == 1
        # every kernel runs after its launch
        launched = rows[rows.launch_ns >= 0]
        assert (launched.start_ns > launched.launch_ns).all()
    assert any("1 of 25 GPU activities have no launching runtime call" in w for w in result.warnings)
    run = Run.open(tmp_path / "run")  # the analyzer's view: the schema's columns
    view = run.store.query("SELECT * FROM kernels")
    assert list(view.columns) == ["rank", "name", "stream", "correlation", "start_ns", "end_ns"]
    assert len(view) == len(got)
    # events are unchanged by the GPU activity: cudaLaunchKernel and kernels are not compute spans
    assert set(run.events(steps=(0, STEPS - 1)).name) == {"forward"}
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["import"]["rows"]["kernels"] == len(got)
    assert [s["gpu_activities"] for s in manifest["import"]["sources"]] == [len(expected[0]), len(expected[1])]
    assert not list(spool_root.glob("megascope-kineto-*")), "spools must be removed"


def test_cpu_only_trace_writes_no_kernels(tmp_path: Path, spool_root: Path):
    trace, _ = gpu_trace(0, world=1)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in kineto_gpu.GPU_CATS]
    import_run("kineto", [_write(tmp_path / "trace_rank0.json", trace)], tmp_path / "run")
    assert not (tmp_path / "run" / "kernels").exists()
    assert not list(spool_root.glob("megascope-kineto-*"))


def test_truncated_gpu_trace_keeps_the_readable_rank_and_no_spool(tmp_path: Path, spool_root: Path, monkeypatch):
    monkeypatch.setattr(spool, "SPOOL_ROWS", 2)  # spool files exist when the file breaks off
    good = _write(tmp_path / "trace_rank0.json", gpu_trace(0)[0])
    text = json.dumps(gpu_trace(1)[0])
    cut = text.index('"cat": "gpu_memset"') + 200
    bad = tmp_path / "trace_rank1.json"
    bad.write_text(text[:cut])
    result = import_run("kineto", [good, bad], tmp_path / "run")
    assert result.ranks == [0] and result.failed_sources == [str(bad)]
    assert set(_kernels(tmp_path / "run")["rank"]) == {0}
    assert not list(spool_root.glob("megascope-kineto-*"))


# ---- communication kernels: one row of comm_kernels' table per name, as profilers have recorded them ----
COMM_KERNEL_NAMES = [
    # NCCL >= 2.19
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("all_reduce", "collective")),
    ("ncclDevKernel_AllReduce_Sum_bf16_TREE_LL128(ncclDevKernelArgsStorage<4096ul>)", ("all_reduce", "collective")),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("all_gather", "collective")),
    ("ncclDevKernel_AllGather_PAT_SIMPLE(ncclDevKernelArgsStorage<4096ul>)", ("all_gather", "collective")),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     ("reduce_scatter", "collective")),
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("broadcast", "collective")),
    ("ncclDevKernel_Reduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("reduce", "collective")),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ("send_recv", "p2p")),
    # NCCL 2.8 - 2.18
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", ("all_reduce", "collective")),
    ("void ncclKernel_AllReduce_RING_LL_Sum_half(ncclDevComm*, unsigned long, ncclWork*)",
     ("all_reduce", "collective")),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", ("all_gather", "collective")),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_bf16(ncclDevComm*, unsigned long, ncclWork*)",
     ("reduce_scatter", "collective")),
    ("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", ("broadcast", "collective")),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", ("send_recv", "p2p")),
    # NCCL <= 2.7
    ("ncclAllReduceRingLLKernel_sum_f32(ncclColl)", ("all_reduce", "collective")),
    ("ncclAllReduceTreeLL128Kernel_sum_f16(ncclColl)", ("all_reduce", "collective")),
    ("ncclAllGatherRingLLKernel_copy_i8(ncclColl)", ("all_gather", "collective")),
    ("ncclSendRecvKernel_copy_i8(ncclWorkElem)", ("send_recv", "p2p")),
    # RCCL
    ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", ("unknown", "comm")),
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", ("unknown", "comm")),
    ("ncclDevKernelDebug_Generic(ncclDevKernelArgsStorage<4096ul>)", ("unknown", "comm")),
    ("ncclKernel_AllToAllPivot_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
     ("all_to_all", "collective")),
    # a future NCCL scheme: still communication, op unknown
    ("ncclDevKernelV3_AllReduce(ncclDevKernelArgsStorage<8192ul>)", ("unknown", "comm")),
    # not communication
    ("ampere_sgemm_64x64_nn", None),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", None),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
     "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)", None),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t> >"
     "(Flash_fwd_params)", None),
]


@pytest.mark.parametrize("name, expected", COMM_KERNEL_NAMES, ids=[n.split("(")[0][:60] for n, _ in COMM_KERNEL_NAMES])
def test_comm_kernel_names(name: str, expected):
    assert comm_kernel(name) == expected


def test_nccl_kernels_are_marked_and_a_trace_without_any_is_warned(tmp_path: Path, spool_root: Path):
    """World 2: rank 0's kernels include NCCL >= 2.19 all-reduce and send/recv kernels, rank 1's have
    none (the trace of a job whose communication the profiler missed): rank 1 gets one warning."""
    trace, _ = gpu_trace(0)
    gpu = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    gpu[1]["name"] = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    gpu[2]["name"] = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    paths = [_write(tmp_path / "trace_rank0.json", trace), _write(tmp_path / "trace_rank1.json", gpu_trace(1)[0])]
    result = import_run("kineto", paths, tmp_path / "run")
    got = _kernels(tmp_path / "run")
    comm = got[got.comm_kind != ""]
    assert sorted(zip(comm["rank"], comm.comm_op, comm.comm_kind)) == [(0, "all_reduce", "collective"),
                                                                       (0, "send_recv", "p2p")]
    assert set(got[got.comm_kind == ""].comm_op) == {""}
    warned = [w for w in result.warnings if "known NCCL/RCCL communication kernel" in w]
    assert len(warned) == 1 and warned[0].startswith("rank 1:"), result.warnings
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [s["comm_kernels"] for s in manifest["import"]["sources"]] == [2, 0]


def test_single_process_gpu_trace_without_comm_kernels_is_not_warned(tmp_path: Path, spool_root: Path):
    result = import_run("kineto", [_write(tmp_path / "trace_rank0.json", gpu_trace(0, world=1)[0])], tmp_path / "run")
    assert not [w for w in result.warnings if "communication kernel" in w]
