"""Self-checks before a restart (MegaScale 4.3): a GEMM speed test on every rank and bandwidth tests
between ranks (a world all-reduce and a ring of point-to-point transfers, MegaScale's NCCL tests);
ranks, links and hosts far below their peers are flagged with robust statistics (median and MAD).

Runs in the worker right after the process groups exist: on every restart of the worker group
(TORCHELASTIC_RESTART_COUNT > 0) and, with robust.self_check = "always", at the first start too.
Every rank computes the same decision from the same gathered numbers; rank 0 writes
RUN/self_check/attempt-NN.json. The decision is enforced on GPUs only: CPU ranks share cores, so a
slow CPU rank is scheduling noise, not a bad device (the numbers are still recorded).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megascope.tracer import comm
from megascope.tracer.run_dir import SELF_CHECK_DIR, write_json_atomic

ROBUST_Z = 3.0
"""How many robust standard deviations (1.4826 * MAD) below the median an outlier must also be."""


class SelfCheckError(RuntimeError):
    """The self-check found a bad node that cannot be excluded: the job stops with the diagnosis."""


def self_check_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SELF_CHECK_DIR


# ---------------------------------------------------------------------- statistics and decision

def low_outliers(values: dict[Any, float], threshold: float) -> list[Any]:
    """Keys whose value is below threshold * median AND more than ROBUST_Z robust deviations below
    it (both: a tight group must not flag 1% noise, a noisy one must not flag its normal spread)."""
    if len(values) < 2:
        return []
    med = statistics.median(values.values())
    mad = statistics.median(abs(v - med) for v in values.values())
    scale = 1.4826 * mad
    return sorted(k for k, v in values.items()
                  if v < threshold * med and (scale == 0 or (med - v) / scale > ROBUST_Z))


@dataclass
class NodeDecision:
    action: str
    """continue (nothing flagged), exclude (drop the bad hosts, the rest still forms a valid layout) or stop."""
    exclude: list[str] = field(default_factory=list)
    nodes_after: int = 0
    dp_after: int = 0
    reason: str = ""


def decide(bad_hosts: list[str], hosts: list[str], nproc_per_node: int, tp: int, pp: int,
           valid_dp: Callable[[int], bool], spare_hosts: int = 0, dp_change_ok: bool = False) -> NodeDecision:
    """Exclude the bad hosts when the remaining ones (plus spares) still form a valid layout, else stop.

    Spares (an elastic node range) replace bad hosts one for one and keep the layout. Without enough
    spares the job would shrink: dp' = remaining ranks / (tp * pp) must be a whole, valid degree
    (`valid_dp`, e.g. the batch still divides) and the checkpoint must be loadable at dp'
    (`dp_change_ok`; megascope's checkpoints refuse a dp change, so by default this stops)."""
    bad = sorted(set(bad_hosts) & set(hosts))
    n = len(hosts)
    dp_now = n * nproc_per_node // (tp * pp)
    if not bad:
        return NodeDecision("continue", [], n, dp_now, "no host below its peers")
    if spare_hosts >= len(bad):
        return NodeDecision("exclude", bad, n, dp_now,
                            f"exclude {bad}: {len(bad)} spare host(s) take their place, layout unchanged")
    remaining = (n - len(bad) + spare_hosts) * nproc_per_node
    if remaining == 0:
        return NodeDecision("stop", bad, 0, 0, f"every host is flagged ({bad}); nothing left to run on")
    if remaining % (tp * pp):
        return NodeDecision("stop", bad, n - len(bad), 0,
                            f"without {bad}, {remaining} ranks do not split into tp*pp={tp * pp} groups")
    dp_after = remaining // (tp * pp)
    if not valid_dp(dp_after):
        return NodeDecision("stop", bad, n - len(bad), dp_after,
                            f"without {bad}, dp would be {dp_after}, which the batch settings do not allow")
    if not dp_change_ok:
        return NodeDecision("stop", bad, n - len(bad), dp_after,
                            f"without {bad}, dp would change {dp_now} -> {dp_after}, and the checkpoint "
                            "cannot be resumed across a dp change; replace the host(s) and restart")
    return NodeDecision("exclude", bad, n - len(bad), dp_after, f"exclude {bad}; continue with dp={dp_after}")


# ---------------------------------------------------------------------- measurements

def gemm_tflops(device: torch.device, repeats: int = 5) -> float:
    """Best-of-`repeats` matmul throughput (the best, so a descheduled moment does not count)."""
    n, dtype, inner = (4096, torch.bfloat16, 10) if device.type == "cuda" else (256, torch.float32, 8)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms up
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                a @ b
            end.record()
            end.synchronize()  # note: this is a CPU-GPU sync point (self-check only)
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                a @ b
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * n ** 3 * inner / best / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: this is a CPU-GPU sync point (bandwidth timing)


def allreduce_busbw(group: dist.ProcessGroup | None, world: int, device: torch.device, nbytes: int,
                    repeats: int = 3) -> float:
    """Bus bandwidth (GB/s) of a world all-reduce: 2(n-1)/n * bytes / time, best of `repeats`."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        comm.all_reduce(buf, group, "world", name="self_check_all_reduce")
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * (world - 1) / world * nbytes / best / 1e9


def ring_p2p_gbps(rank: int, world: int, device: torch.device, nbytes: int, repeats: int = 3) -> float:
    """Bandwidth (GB/s) of the link from rank-1 to this rank: everyone sends to rank+1 at once."""
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    best = float("inf")
    for _ in range(repeats + 1):
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        _sync(device)
        t0 = time.perf_counter()
        for work in comm.batch_isend_irecv(ops, group_name="world", names=["self_check_send", "self_check_recv"]):
            work.wait()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_self_check(run_dir: str | Path, rank: int, world: int, device: torch.device, hosts: list[str],
                   attempt: int, threshold: float, decide_nodes: Callable[[list[str]], NodeDecision]) -> dict:
    """Measure on every rank, gather, flag, decide; rank 0 writes the record. Collective.
    `hosts[r]` is rank r's host; `decide_nodes(bad_hosts)` applies the layout rules (see decide)."""
    nbytes = (64 << 20) if device.type == "cuda" else (4 << 20)
    t0 = time.perf_counter()
    group = dist.group.WORLD
    dist.barrier()  # everyone measures at the same time, like the training load
    mine = {"gemm_tflops": gemm_tflops(device)}
    if world > 1:
        mine["p2p_in_gbps"] = ring_p2p_gbps(rank, world, device, nbytes)
        mine["allreduce_busbw_gbps"] = allreduce_busbw(group, world, device, nbytes)
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    gemm = {r: g["gemm_tflops"] for r, g in enumerate(gathered)}
    links = {f"{(r - 1) % world}->{r}": g["p2p_in_gbps"] for r, g in enumerate(gathered) if "p2p_in_gbps" in g}
    slow_ranks = low_outliers(gemm, threshold)
    slow_links = low_outliers(links, threshold)
    # a rank whose incoming and outgoing links are both slow is the likely culprit of those links
    link_ranks = {r for r in range(world) if f"{(r - 1) % world}->{r}" in slow_links
                  and f"{r}->{(r + 1) % world}" in slow_links}
    flagged = sorted(set(slow_ranks) | link_ranks)
    bad_hosts = sorted({hosts[r] for r in flagged})
    decision = decide_nodes(bad_hosts)
    record = {"attempt": attempt, "device": device.type, "world": world, "seconds": time.perf_counter() - t0,
              "threshold": threshold, "hosts": hosts, "ranks": {str(r): g for r, g in enumerate(gathered)},
              "links": links, "flagged_ranks": flagged, "slow_gemm_ranks": slow_ranks, "slow_links": slow_links,
              "flagged_hosts": bad_hosts, "decision": asdict(decision), "enforced": device.type == "cuda"}
    if rank == 0:
        write_json_atomic(self_check_dir(run_dir) / f"attempt-{attempt:02d}.json", record)
    return record
