"""megascope.tracer.attach on real 2-rank gloo groups: every intercepted torch.distributed call is
recorded once with its group, seq, peer and bytes, async work is still a dist.Work, the originals are
back after close; the DDP communication hook records each bucket and leaves DDP's gradients as they
are without it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from megascope import tracer
from megascope.samples.distributed import run_distributed
from megascope.tracer import comm
from megascope.tracer.config import TraceConfig

pytestmark = pytest.mark.slow

ORIGINALS = {name: getattr(c10d, name) for name in ("all_reduce", "isend", "batch_isend_irecv", "all_gather_single")}


def _events(run_dir: str, rank: int) -> list[dict]:
    table = pq.read_table(Path(run_dir) / "events" / f"rank={rank:05d}", partitioning=None)
    return table.sort_by("issue_ns").to_pylist()


def _intercepted_job(rank: int, world: int, run_dir: str) -> dict:
    peer = 1 - rank
    results = {}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))  # the layout from a real DeviceMesh
    with tracer.attach(run_dir, layout=mesh, config=TraceConfig(nvml=False)) as t:
        x = torch.full((4,), float(rank + 1))
        dist.all_reduce(x)
        results["sum"] = x.tolist()
        work = dist.all_reduce(torch.ones(8), async_op=True)
        results["is_work"] = isinstance(work, dist.Work)
        work.wait()
        dist.broadcast(torch.zeros(16), src=0)
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8))
        dist.all_to_all_single(torch.empty(6), torch.ones(6))
        comm.all_reduce(torch.ones(2), dist.group.WORLD, "dp")  # megascope's wrapper records it itself
        t.step()
        buf = torch.zeros(3)
        if rank == 0:
            dist.send(torch.ones(3), dst=1)
            dist.isend(torch.ones(3), dst=1).wait()
        else:
            dist.recv(buf, src=0)
            dist.irecv(buf, src=0).wait()
        ops = [dist.P2POp(dist.isend, torch.ones(5), peer), dist.P2POp(dist.irecv, torch.zeros(5), peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        ops = [dist.P2POp(dist.isend, torch.ones(5), peer), dist.P2POp(dist.irecv, torch.zeros(5), peer)]
        for w in comm.batch_isend_irecv(ops, "dp", names=["send_x", "recv_x"]):  # recorded by comm alone
            w.wait()
        t.step()
    dist.all_reduce(torch.ones(1))  # after close: untraced
    results["restored"] = all(getattr(c10d, n) is f and getattr(dist, n) is f for n, f in ORIGINALS.items())
    return results


def test_intercepted_calls_are_recorded_once_with_group_seq_peer_bytes(tmp_path):
    run = str(tmp_path / "run")
    results = run_distributed(_intercepted_job, 2, run)
    assert [r["sum"] for r in results] == [[3.0] * 4] * 2
    assert all(r["is_work"] and r["restored"] for r in results)
    topology = json.loads((tmp_path / "run" / "run.json").read_text())["topology"]
    assert (topology["world"], topology["dp"], [r["dp"] for r in topology["ranks"]]) == (2, 2, [0, 1])
    by_rank = [_events(run, r) for r in (0, 1)]
    for rank, events in enumerate(by_rank):
        coll = [(e["name"], e["group"], e["seq"], e["bytes"]) for e in events if e["kind"] == "collective"]
        assert coll == [("all_reduce", "dp", 0, 16), ("all_reduce", "dp", 1, 32), ("broadcast", "dp", 2, 64),
                        ("all_gather", "dp", 3, 32), ("reduce_scatter", "dp", 4, 32), ("all_to_all", "dp", 5, 24),
                        ("all_reduce", "dp", 6, 8)]
        p2p = [(e["name"], e["peer"], e["seq"], e["bytes"], e["step"]) for e in events if e["kind"] == "p2p"]
        single = [("send", 1, 0, 12, 1), ("send", 1, 1, 12, 1)] if rank == 0 else \
            [("recv", 0, 0, 12, 1), ("recv", 0, 1, 12, 1)]
        batch = [("send", 1 - rank, 2 if rank == 0 else 0, 20, 1), ("recv", 1 - rank, 0 if rank == 0 else 2, 20, 1)]
        # megascope's own batch: its names, the same per-direction seq (k-th send A->B = k-th recv on B)
        own = [("send_x", 1 - rank, 3 if rank == 0 else 1, 20, 1), ("recv_x", 1 - rank, 1 if rank == 0 else 3, 20, 1)]
        assert sorted(p2p) == sorted(single + batch + own)
        assert all(e["group"] == "dp" for e in events if e["kind"] == "p2p")
        assert all(e["issue_ns"] <= e["start_ns"] <= e["end_ns"] for e in events)
    # the async all-reduce: enqueued (start) after it was asked for (issue), ended at completion
    assert sum(e["name"] == "all_reduce" for e in by_rank[0]) == 3  # the one after close is not there


def _ddp_job(rank: int, world: int, run_dir: str) -> dict:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    traced, plain = DistributedDataParallel(base), DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.SGD(traced.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 16, generator=g) for _ in range(3)]
    same = True
    with tracer.attach(run_dir, model=traced, optimizer=opt, config=TraceConfig(nvml=False)) as t:
        for x in t.data(batches):
            traced(x).pow(2).mean().backward()
            plain(x).pow(2).mean().backward()
            same &= all(torch.allclose(a.grad, b.grad) for a, b in zip(traced.parameters(), plain.parameters()))
            opt.step()
            opt.zero_grad()
            plain.zero_grad()
            for p, q in zip(plain.parameters(), traced.parameters()):
                p.data.copy_(q.data)
            t.step(tokens=8)
    return {"same_grads": same, "ddp_hook": t.ddp_hooked,
            "param_bytes": sum(p.numel() * p.element_size() for p in traced.parameters())}


def test_ddp_hook_records_each_bucket_and_keeps_ddp_gradients(tmp_path):
    run = str(tmp_path / "run")
    results = run_distributed(_ddp_job, 2, run)
    assert all(r["same_grads"] and r["ddp_hook"] for r in results)
    for rank in (0, 1):
        events = _events(run, rank)
        reduces = [e for e in events if e["name"] == "grad_all_reduce"]
        assert [(e["step"], e["group"], e["seq"], e["kind"]) for e in reduces] == \
            [(s, "dp", s, "collective") for s in range(3)]  # one bucket per step (a small model)
        assert all(e["bytes"] == results[rank]["param_bytes"] for e in reduces)
        assert all(e["issue_ns"] <= e["start_ns"] <= e["end_ns"] for e in reduces)
        names = [e["name"] for e in events if e["step"] == 1]
        for name in ("data_wait", "forward", "backward", "optimizer"):
            assert names.count(name) == 1, (name, names)
        backward = next(e for e in events if e["step"] == 1 and e["name"] == "backward")
        bucket = next(e for e in reduces if e["step"] == 1)
        assert backward["start_ns"] <= bucket["issue_ns"]  # the bucket is ready during backward
