"""The tracer on real multi-process gloo groups: comm seq matching, async timing, clock sync, hangs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megascope import tracer
from megascope.samples.distributed import run_distributed
from megascope.tracer import comm
from megascope.tracer.config import TraceConfig
from megascope.tracer.run_dir import read_manifest, write_manifest

pytestmark = pytest.mark.slow


def _comm_ops(rank: int, world: int) -> list[dict]:
    """Collectives on world and on a pair group, async and sync, and a p2p ring; returns the events."""
    sink = tracer.MemorySink()
    t = tracer.Tracer(None, rank, TraceConfig(nvml=False), "cpu", sink=sink)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    solo = dist.new_group([rank], use_local_synchronization=True)
    tracer.activate(t)
    x = torch.ones(256)
    for step in range(2):
        tracer.set_step(step)
        tracer.set_microbatch(0)
        comm.all_reduce(x, dist.group.WORLD, "world")
        work = comm.all_reduce(x, pair, "dp", async_op=True, name="grad_all_reduce")
        work.wait()
        out = torch.empty(256 // 2)
        comm.reduce_scatter_tensor(out, x, pair, "dp")
        comm.all_gather_into_tensor(x, out, pair, "dp")
        comm.all_reduce(x, solo, "tp")  # size-1 group: untraced no-op
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        recv = torch.empty(16)
        ops = [dist.P2POp(dist.isend, torch.full((16,), float(rank)), nxt),
               dist.P2POp(dist.irecv, recv, prv)]
        for w in comm.batch_isend_irecv(ops, "pp", names=["send_forward", "recv_forward"]):
            w.wait()
        assert recv[0].item() == prv
    tracer.deactivate()
    t.close()
    return sink.table("events").to_pylist()


def test_comm_seq_numbers_match_across_ranks():
    events = run_distributed(_comm_ops, 4)
    by_rank = {r: evs for r, evs in enumerate(events)}
    # collectives: same (group, seq) -> same op name on every member; world group has all 4 ranks
    waits = {r: [e for e in evs if e["kind"] == "host"] for r, evs in by_rank.items()}
    events = [[e for e in evs if e["kind"] != "host"] for evs in events]
    by_rank = {r: evs for r, evs in enumerate(events)}
    world_ops = {r: [(e["seq"], e["name"]) for e in evs if e["group"] == "world"] for r, evs in by_rank.items()}
    assert all(ops == [(0, "all_reduce"), (1, "all_reduce")] for ops in world_ops.values())
    dp = {r: [(e["seq"], e["name"], e["bytes"]) for e in evs if e["group"] == "dp"] for r, evs in by_rank.items()}
    assert dp[0] == dp[1] == dp[2] == dp[3]
    assert [name for _, name, _ in dp[0][:3]] == ["grad_all_reduce", "reduce_scatter", "all_gather"]
    assert [seq for seq, _, _ in dp[0]] == list(range(6))
    assert all(e["group"] != "tp" for evs in events for e in evs)
    # p2p: the k-th send A->B matches the k-th recv on B from A
    for a in range(4):
        b = (a + 1) % 4
        sends = [(e["seq"], e["bytes"]) for e in by_rank[a] if e["name"] == "send_forward" and e["peer"] == b]
        recvs = [(e["seq"], e["bytes"]) for e in by_rank[b] if e["name"] == "recv_forward" and e["peer"] == a]
        assert sends == recvs == [(0, 64), (1, 64)]
    for evs in events:
        for e in evs:
            assert e["kind"] in ("collective", "p2p") and e["issue_ns"] <= e["start_ns"] <= e["end_ns"]
    # wait spans: gloo p2p reports no completion before wait(), so each p2p wait is one; an async
    # collective's wait only when it was still running. Each names its op and carries its seq.
    for r, spans in waits.items():
        ops = {(e["name"], e["group"], e["seq"], e["peer"]) for e in by_rank[r]}
        names = [w["name"] for w in spans]
        assert names.count("send_forward.wait") == names.count("recv_forward.wait") == 2, names
        assert set(names) <= {"send_forward.wait", "recv_forward.wait", "grad_all_reduce.wait"}
        for w in spans:
            assert (w["name"].removesuffix(".wait"), w["group"], w["seq"], w["peer"]) in ops
            assert w["bytes"] == 0 and w["start_ns"] <= w["end_ns"]


def _async_completion(rank: int, world: int) -> list[dict]:
    """Rank 1 joins the all-reduce 0.3 s late; rank 0 waits 0.6 s before calling wait().
    Then a second one that rank 1 joins 0.3 s late while rank 0 waits on it at once (blocks)."""
    sink = tracer.MemorySink()
    t = tracer.Tracer(None, rank, TraceConfig(nvml=False), "cpu", sink=sink)
    tracer.activate(t)
    tracer.set_step(0)
    x = torch.ones(8)
    if rank == 1:
        time.sleep(0.3)
    work = comm.all_reduce(x, dist.group.WORLD, "dp", async_op=True)
    if rank == 0:
        time.sleep(0.6)
    work.wait()
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
    comm.all_reduce(x, dist.group.WORLD, "dp", async_op=True).wait()
    tracer.deactivate()
    t.close()
    return sink.table("events").to_pylist()


def test_async_work_is_timed_to_its_completion_not_to_wait():
    events = run_distributed(_async_completion, 2)
    ops = sorted((e for e in events[0] if e["kind"] == "collective"), key=lambda e: e["seq"])
    waits = [e for e in events[0] if e["name"] == "all_reduce.wait"]
    first, second = ops
    duration_s = (first["end_ns"] - first["start_ns"]) / 1e9
    # it completed when rank 1 joined (~0.3 s), long before rank 0's wait() at ~0.6 s, so rank 0's
    # wait() did not block: no wait span for it
    assert 0.15 < duration_s < 0.55, duration_s
    assert first["issue_ns"] < first["start_ns"]  # start: when the enqueueing call returned
    # the second one: rank 0 blocked in wait() until rank 1 joined; that is a wait span with the op's
    # seq, and the op ends when the wait saw it complete (not later)
    assert [w["seq"] for w in waits] == [second["seq"]], waits
    wait = waits[0]
    assert second["start_ns"] <= wait["start_ns"] < second["end_ns"] <= wait["end_ns"]
    assert (wait["end_ns"] - wait["start_ns"]) / 1e9 > 0.15


SKEW_NS = {0: 0, 1: 3_000_000_000, 2: -7_000_000_000}


def _skewed_sync(rank: int, world: int, run_dir: str, skews: dict[int, int] = SKEW_NS,
                 hosts: dict[int, str] | None = None) -> dict:
    if rank == 0:
        write_manifest(run_dir, {"run_id": "skew"})
    dist.barrier()
    clock = tracer.HostClock(skew_ns=skews[rank], host=hosts[rank] if hosts else None)
    t = tracer.Tracer(run_dir, rank, TraceConfig(nvml=False), "cpu", clock=clock)
    before = t.now_ns()
    result = t.sync_clocks()
    after = t.now_ns()
    dist.barrier()
    stamp = t.now_ns()  # all ranks leave the barrier at nearly the same instant
    t.close()
    return {"offsets": result.offsets_ns, "delays": result.delays_ns, "hosts": result.hosts,
            "before": before, "after": after, "stamp": stamp}


def test_clock_offsets_are_recovered_from_a_simulated_skew(tmp_path: Path):
    results = run_distributed(_skewed_sync, 3, str(tmp_path))
    tolerance_ns = 50_000_000  # the ping-pong bound is delay/2; loose for a busy 2-core machine
    for rank, res in enumerate(results):
        for r, skew in SKEW_NS.items():
            assert abs(res["offsets"][r] - skew) < tolerance_ns, (rank, r, res["offsets"][r])
        assert abs((res["before"] - res["after"]) - SKEW_NS[rank]) < tolerance_ns + 10**9
    stamps = [res["stamp"] for res in results]
    assert max(stamps) - min(stamps) < 500_000_000  # aligned clocks agree; unaligned differ by 10 s
    manifest = read_manifest(tmp_path)
    assert set(manifest["clock_offsets_ns"]) == {"0", "1", "2"}
    assert abs(manifest["clock_offsets_ns"]["2"] - SKEW_NS[2]) < tolerance_ns
    assert manifest["run_id"] == "skew"


def test_clock_sync_across_simulated_hosts_adds_the_two_hops(tmp_path: Path):
    """Two hosts of two ranks: rank 3 is synced by its host leader (rank 2), rank 2 by rank 0; the
    skews differ inside a host too, so both hops must be measured and added."""
    skews = {0: 0, 1: 2_000_000_000, 2: 5_000_000_000, 3: -4_000_000_000}
    hosts = {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}
    results = run_distributed(_skewed_sync, 4, str(tmp_path), skews, hosts)
    tolerance_ns = 50_000_000
    for rank, res in enumerate(results):
        for r, skew in skews.items():
            assert abs(res["offsets"][r] - skew) < tolerance_ns, (rank, r, res["offsets"][r])
    assert all(res["hosts"] == 2 for res in results)
    delays = results[0]["delays"]
    assert delays[0] == 0 and min(delays[1], delays[2], delays[3]) > 0
    assert delays[3] > delays[2]  # rank 3's uncertainty includes its leader's hop to rank 0
    stamps = [res["stamp"] for res in results]
    assert max(stamps) - min(stamps) < 500_000_000


def _hang(rank: int, world: int, run_dir: str) -> dict:
    cfg = TraceConfig(nvml=False, hang_timeout_s=0.3)
    t = tracer.Tracer(run_dir, rank, cfg, "cpu")
    tracer.activate(t)
    tracer.set_step(5)
    tracer.set_microbatch(1)
    x = torch.ones(4)
    comm.all_reduce(x, dist.group.WORLD, "dp", name="warmup")  # completes: becomes last_completed
    record = Path(run_dir) / "inflight" / "rank=00000.json"
    seen = None
    if rank == 0:
        comm.all_reduce(x, dist.group.WORLD, "dp", name="grad_all_reduce")  # blocks until rank 1 joins
    else:
        deadline = time.monotonic() + 30  # rank 1 "hangs": it joins only after rank 0 reported
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = json.loads(record.read_text())
        comm.all_reduce(x, dist.group.WORLD, "dp", name="grad_all_reduce")
    dist.barrier()
    if rank == 0:
        deadline = time.monotonic() + 10
        while json.loads(record.read_text())["state"] != "resolved" and time.monotonic() < deadline:
            time.sleep(0.05)
    tracer.deactivate()
    t.close()
    return {"seen": seen, "reports": t.stats()["watchdog_reports"]}


def test_hang_writes_an_inflight_record_while_blocked(tmp_path: Path):
    results = run_distributed(_hang, 2, str(tmp_path))
    seen = results[1]["seen"]
    assert seen is not None and seen["state"] == "waiting" and seen["rank"] == 0
    op = seen["waiting_on"]
    assert (op["op"], op["group"], op["seq"], op["peers"], op["bytes"]) == ("grad_all_reduce", "dp", 1, [0, 1], 16)
    assert (seen["step"], seen["microbatch"]) == (5, 1)
    assert seen["last_completed"]["op"] == "warmup"
    assert op["since_ns"] < seen["written_ns"]
    assert not (tmp_path / "inflight" / "rank=00001.json").exists()  # rank 1 never waited
    resolved = json.loads((tmp_path / "inflight" / "rank=00000.json").read_text())
    assert resolved["state"] == "resolved" and results[0]["reports"] == 2
