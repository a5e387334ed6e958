"""The control plane without a shared filesystem: a real 3-rank gloo job publishes heartbeats and hang
records through a real TCPStore (hosted here as `megascope train`'s driver hosts it); a rank frozen
with SIGSTOP is judged silent from the store, the waiting ranks' in-flight records reach RUN/inflight/
and the hang analysis names the frozen rank. A store that is gone costs counted failures, never a crash."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megascope.samples.distributed import free_port
from megascope.tracer import control_store
from megascope.tracer.control_store import ControlStore
from megascope.trainer.config import RobustConfig
from megascope.trainer.robust.heartbeat import Heartbeat, read_heartbeats
from megascope.trainer.robust.supervisor import ControlPlaneHost, Supervisor

WORLD, FROZEN = 3, 2


def _rank(rank: int, port: int, run_dir: str) -> None:
    """One rank: heartbeats and the tracer's watchdog find the store through $MEGASCOPE_CONTROL_STORE."""
    import torch.distributed as dist

    from megascope import tracer
    from megascope.tracer import comm
    from megascope.tracer.config import TraceConfig
    from megascope.tracer.run_dir import write_manifest

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    beat = Heartbeat(run_dir, rank, interval_s=0.1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if rank == 0:
        host = socket.gethostname()
        write_manifest(run_dir, {"run_id": "store", "source": "test", "topology": {"ranks": [
            {"rank": r, "pp": 0, "dp": r, "tp": 0, "host": host, "local_rank": r} for r in range(WORLD)]}})
    t = tracer.Tracer(run_dir, rank, TraceConfig(nvml=False, hang_timeout_s=0.5, flush_interval_s=0.2), "cpu")
    tracer.activate(t)
    x = torch.ones(8)
    for step in range(100_000):  # until the test kills the job
        tracer.set_step(step)
        beat.update(step=step, status="training")
        with tracer.span("compute"):
            time.sleep(0.02)
        comm.all_reduce(x, dist.group.WORLD, "dp", name="grad_all_reduce")


def test_a_frozen_rank_is_found_through_the_store(tmp_path):
    host = ControlPlaneHost(nnodes=1, node_rank=0, rdzv_endpoint="")  # sets $MEGASCOPE_CONTROL_STORE
    assert host.client is not None and os.environ[control_store.ENV] == host.address
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path)), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    robust = RobustConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0, stall_timeout_s=0)
    sup = Supervisor(tmp_path, robust, world=WORLD, max_restarts=0, store=host.client)
    try:
        deadline = time.monotonic() + 120
        while True:  # every rank beats through the store and is past step 3
            beats = read_heartbeats(tmp_path, store=host.client)
            if len(beats) == WORLD and min(b["step"] for b in beats.values()) >= 3:
                break
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "ranks did not start"
            time.sleep(0.05)
        assert {b["pid"] for b in beats.values()} == {p.pid for p in procs}
        sup.start()
        os.kill(procs[FROZEN].pid, signal.SIGSTOP)  # frozen: no beat, no record, no exit
        while not sup.incidents:
            assert time.monotonic() < deadline, "the frozen rank was not detected"
            time.sleep(0.05)
    finally:
        sup.stop()
        for p in procs:  # the supervisor killed them (SIGKILL ends a stopped process too); be sure
            if p.is_alive():
                p.kill()
            p.join(10)
        host.close()
    incident = sup.incidents[0]
    assert incident["kind"] == "silent_rank" and incident["ranks"] == [FROZEN], incident
    assert incident["inflight_records"] >= WORLD - 1
    health = json.loads((tmp_path / "health.json").read_text())
    assert health["source"] == f"control store {host.address}" and health["store_failures"] == 0
    assert not (tmp_path / "heartbeats").exists()  # nothing went through files
    # the waiting ranks' records came out of the store into the run directory; the frozen one wrote none
    written = sorted(p.name for p in (tmp_path / "inflight").glob("rank=*.json"))
    assert written == [f"rank={r:05d}.json" for r in range(WORLD) if r != FROZEN]
    record = json.loads((tmp_path / "inflight" / "rank=00000.json").read_text())
    assert record["state"] == "waiting" and record["waiting_on"]["peers"] == list(range(WORLD))

    from megascope.analyzer import Run

    hang = Run.open(tmp_path).hang()
    assert hang is not None and hang.suspects == [FROZEN] and hang.waiting == [0, 1]
    assert "grad_all_reduce" in hang.op


def _dead_address() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", s.getsockname()[1]  # closed again: nobody listens there


def test_a_store_that_is_gone_is_counted_and_survived(tmp_path):
    store = ControlStore(*_dead_address(), timeout_s=0.3)
    assert store.put("heartbeat", 0, {"rank": 0}) is False and store.get_all("heartbeat") is None
    assert store.version("inflight") is None and store.failures == 3 and "version inflight" in store.last_error
    beat = Heartbeat(tmp_path, rank=0, interval_s=0.05, store=store)
    beat.update(step=1, beat_now=True)  # no exception: monitoring never stops training
    beat.close("done")
    assert beat.store_failures >= 3 and not (tmp_path / "heartbeats").exists()
    sup = Supervisor(tmp_path, RobustConfig(heartbeat_timeout_s=3.0), world=1, max_restarts=0,
                     store=store, kill=lambda pid: pytest.fail("killed on a store outage"))
    assert sup.poll(0.0) is None and sup.poll(100.0) is None and sup.incidents == []


def test_bad_control_store_address_falls_back_to_files(tmp_path, monkeypatch):
    monkeypatch.setenv(control_store.ENV, "no-port-here")
    assert control_store.from_env() is None  # logged, not raised
    beat = Heartbeat(tmp_path, rank=4, interval_s=0.05)
    beat.close("done")
    assert read_heartbeats(tmp_path)[4]["status"] == "done"  # the file fallback
    assert Path(tmp_path / "heartbeats" / "rank=00004.json").is_file()
