"""Heartbeats, the supervisor's detectors (with fake processes and clock), self-check statistics and
the node decision (fakes: one real node), group creation, and the self-check on real ranks."""

from __future__ import annotations

import json

import pytest
import torch

from megascope.samples.distributed import run_distributed
from megascope.trainer.config import RobustConfig
from megascope.trainer.robust.heartbeat import Heartbeat, read_heartbeats
from megascope.trainer.robust.self_check import decide, low_outliers
from megascope.trainer.robust.supervisor import Supervisor, stall_suspects


def write_beat(run_dir, rank, seq, step, status="training", pid=None, restart=0, host="h0", event=None):
    d = run_dir / "heartbeats"
    d.mkdir(exist_ok=True)
    (d / f"rank={rank:05d}.json").write_text(json.dumps(
        {"rank": rank, "host": host, "pid": pid or 1000 + rank, "restart": restart, "seq": seq,
         "step": step, "status": status, "last_event": event}))


def make_supervisor(tmp_path, alive=lambda pid: True, max_restarts=1, **robust):
    killed, stopped = [], []
    cfg = RobustConfig(heartbeat_timeout_s=3.0, stall_timeout_s=10.0, **robust)
    sup = Supervisor(tmp_path, cfg, world=2, max_restarts=max_restarts, host="h0",
                     kill=killed.append, alive=alive, on_stop_job=lambda: stopped.append(True))
    return sup, killed, stopped


def test_heartbeat_reports_fields_and_final_status(tmp_path):
    hb = Heartbeat(tmp_path, rank=3, interval_s=0.05, restart=1, local_rank=3)
    hb.update(step=7, status="training", beat_now=True)
    beat = read_heartbeats(tmp_path)[3]
    assert (beat["step"], beat["status"], beat["restart"], beat["local_rank"]) == (7, "training", 1, 3)
    assert beat["pid"] > 0 and beat["host"] and beat["seq"] >= 2
    hb.close("done")
    assert read_heartbeats(tmp_path)[3]["status"] == "done"
    with pytest.raises(ValueError, match="unknown"):
        hb.update(status="sleeping")


def test_supervisor_detects_a_silent_rank_and_stops_the_group(tmp_path):
    sup, killed, _ = make_supervisor(tmp_path)
    for seq, now in enumerate([0.0, 1.0, 2.0, 3.0]):
        write_beat(tmp_path, 0, seq, step=seq)  # rank 0 keeps beating (and progressing)
        write_beat(tmp_path, 1, 0, step=0)      # rank 1 went quiet after its first beat
        assert sup.poll(now) is None
    incident = sup.poll(4.0)
    assert incident["kind"] == "silent_rank" and incident["ranks"] == [1]
    assert sorted(killed) == [1000, 1001] and "restarts" in incident["action"]
    assert json.loads((tmp_path / "incidents.jsonl").read_text().splitlines()[0])["kind"] == "silent_rank"
    assert (tmp_path / "health.json").is_file()


def test_supervisor_detects_a_stall_and_names_the_idle_rank(tmp_path):
    sup, killed, _ = make_supervisor(tmp_path)
    waiting = {"state": "in_flight", "op": "send_forward", "step": 3}
    stale = {"state": "in_flight", "op": "param_all_gather", "step": 2}  # an old prefetch, not a wait
    for seq, now in enumerate(range(0, 12)):
        write_beat(tmp_path, 0, seq, step=3, event=waiting)
        write_beat(tmp_path, 1, seq, step=3, event=stale)
        incident = sup.poll(float(now))
    assert incident is not None and incident["kind"] == "stall" and incident["ranks"] == [1]
    assert sorted(killed) == [1000, 1001]
    assert stall_suspects({0: {"last_event": waiting}, 1: {"last_event": None}}) == [1]


def test_supervisor_judges_stalls_only_once_every_rank_trains(tmp_path):
    """Start-up (imports, groups, model, restore) is no stall: under CPU contention it outlasted a 5 s
    stall timeout and the supervisor killed a healthy job before its first step."""
    sup, killed, _ = make_supervisor(tmp_path)
    for seq, now in enumerate(range(0, 30)):
        write_beat(tmp_path, 0, seq, step=0)
        write_beat(tmp_path, 1, seq, step=-1, status="restoring")  # still starting, 29 s on
        assert sup.poll(float(now)) is None
    assert killed == []
    for seq, now in enumerate(range(30, 42), start=30):
        write_beat(tmp_path, 0, seq, step=0)
        write_beat(tmp_path, 1, seq, step=0)  # both train, then make no progress
        incident = sup.poll(float(now))
    assert incident is not None and incident["kind"] == "stall"


def test_supervisor_records_a_dead_rank_once_and_a_restart(tmp_path):
    dead = {1001}
    sup, killed, _ = make_supervisor(tmp_path, alive=lambda pid: pid not in dead)
    write_beat(tmp_path, 0, 1, step=2)
    write_beat(tmp_path, 1, 1, step=2)
    incident = sup.poll(0.0)
    assert incident["kind"] == "dead_rank" and incident["ranks"] == [1] and killed == []  # the agent acts
    assert sup.poll(0.5) is None  # handled once per attempt
    write_beat(tmp_path, 0, 1, step=-1, status="starting", restart=1, pid=2000)
    write_beat(tmp_path, 1, 1, step=-1, status="starting", restart=1, pid=2001)
    assert sup.poll(1.0) is None
    assert [i["kind"] for i in sup.incidents] == ["dead_rank", "restart"]


def test_finished_ranks_are_not_dead(tmp_path):
    sup, _, _ = make_supervisor(tmp_path, alive=lambda pid: False)
    write_beat(tmp_path, 0, 5, step=9, status="done")
    write_beat(tmp_path, 1, 5, step=9, status="done")
    assert sup.poll(100.0) is None and sup.incidents == []


def test_enforced_self_check_stop_ends_the_job(tmp_path):
    sup, _, stopped = make_supervisor(tmp_path)
    write_beat(tmp_path, 0, 1, step=-1, status="self_check")
    (tmp_path / "self_check").mkdir()
    (tmp_path / "self_check" / "attempt-00.json").write_text(json.dumps(
        {"enforced": True, "flagged_ranks": [1], "flagged_hosts": ["h0"],
         "decision": {"action": "stop", "exclude": ["h0"], "reason": "every host is flagged"}}))
    incident = sup.poll(0.0)
    assert incident["kind"] == "self_check" and stopped == [True]


def test_low_outliers_use_robust_statistics():
    assert low_outliers({0: 10.0, 1: 10.2, 2: 9.9, 3: 3.0}, 0.5) == [3]
    assert low_outliers({0: 10.0, 1: 10.2, 2: 9.9, 3: 9.0}, 0.5) == []  # slower, not far below
    assert low_outliers({0: 10.0, 1: 1.0}, 0.5) == []  # two values: no majority to be an outlier from
    assert low_outliers({0: 5.0}, 0.5) == []


ok = lambda dp: dp in (1, 2, 4)  # noqa: E731  (the batch divides for these dp)


@pytest.mark.parametrize("bad,hosts,spares,dp_change,action,exclude", [
    ([], ["a", "b"], 0, False, "continue", []),
    (["b"], ["a", "b"], 1, False, "exclude", ["b"]),       # a spare node keeps the layout
    (["b"], ["a", "b"], 0, True, "exclude", ["b"]),        # dp 4 -> 2 is valid and resumable
    (["b"], ["a", "b"], 0, False, "stop", ["b"]),          # dp would change, checkpoint refuses
    (["c"], ["a", "b", "c"], 0, True, "exclude", ["c"]),   # dp 6 -> 4, allowed
    (["d"], ["a", "b", "c", "d"], 0, True, "stop", ["d"]), # dp 8 -> 6, the batch does not divide
    (["a"], ["a"], 0, True, "stop", ["a"]),                # nothing left
])
def test_node_decision(bad, hosts, spares, dp_change, action, exclude):
    # 2 ranks per node, tp*pp = 1*1 -> dp = ranks; 'ok' allows dp 1, 2, 4
    d = decide(bad, hosts, nproc_per_node=2, tp=1, pp=1, valid_dp=ok, spare_hosts=spares, dp_change_ok=dp_change)
    assert (d.action, d.exclude) == (action, exclude), d.reason
    assert d.reason


def test_node_decision_needs_whole_model_parallel_groups():
    d = decide(["d"], ["a", "b", "c", "d"], nproc_per_node=2, tp=2, pp=2, valid_dp=lambda dp: True, dp_change_ok=True)
    assert d.action == "stop" and "tp*pp=4" in d.reason


def groups_worker(rank: int, world: int, method: str) -> dict:
    import torch.distributed as dist

    from megascope.trainer.parallel.parallel_dims import ParallelDims

    dims = ParallelDims(dp=2, tp=1, pp=2)
    dims.build_groups(method)
    out = {}
    for name in ("tp", "dp", "pp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=dims.groups[name])
        out[name] = (sorted(dist.get_process_group_ranks(dims.groups[name])), t.item())
    return out


@pytest.mark.parametrize("method", ["local", "enumeration"])
def test_group_creation_methods_build_the_same_groups(method):
    results = run_distributed(groups_worker, 4, method)
    from megascope.trainer.parallel.parallel_dims import ParallelDims

    dims = ParallelDims(dp=2, tp=1, pp=2)
    for rank, r in enumerate(results):
        for name in ("tp", "dp", "pp"):
            assert r[name] == (dims.peers(name, rank), float(sum(dims.peers(name, rank))))


def self_check_worker(rank: int, world: int, run_dir: str) -> dict:
    from megascope.trainer.robust.self_check import run_self_check

    return run_self_check(run_dir, rank, world, torch.device("cpu"), ["h0"] * world, 1, 0.5,
                          lambda bad: decide(bad, ["h0"], world, 1, 1, lambda dp: True))


def test_self_check_measures_every_rank_and_link(tmp_path):
    results = run_distributed(self_check_worker, 3, str(tmp_path))
    record = json.loads((tmp_path / "self_check" / "attempt-01.json").read_text())
    assert record["flagged_ranks"] == results[0]["flagged_ranks"] == results[2]["flagged_ranks"]
    assert sorted(record["links"]) == ["0->1", "1->2", "2->0"]
    assert all(v["gemm_tflops"] > 0 and v["p2p_in_gbps"] > 0 and v["allreduce_busbw_gbps"] > 0
               for v in record["ranks"].values())
    assert record["enforced"] is False and record["decision"]["action"] in ("continue", "stop")
