"""The multi-node pieces one by one: the rendezvous id every node derives, the roll call on a real TCPStore
(on 127.0.0.1), and which ranks make a lost node."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from megascope.tracer.control_store import ControlStore
from megascope.trainer.robust.node_loss import lost_ranks, node_lost_incident
from megascope.trainer.robust.roll_call import KIND, RollCall, rendezvous_id


def test_every_node_derives_the_same_id_from_the_run_directory() -> None:
    assert rendezvous_id("", "/shared/runs/exp7") == rendezvous_id("", "runs/exp7/") == "megascope-exp7"
    assert rendezvous_id("", "s3://bucket/runs/exp7") == "megascope-exp7"
    assert rendezvous_id("job-42", "/shared/runs/exp7") == "job-42"


def _store() -> tuple[dist.TCPStore, ControlStore]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    return server, ControlStore("127.0.0.1", port)


def test_roll_call_names_the_missing_node_and_refuses_another_run() -> None:
    server, store = _store()
    said: list[str] = []
    line = RollCall(store, 3, 0, "megascope-a", timeout_s=0.3, poll_s=0.05, say_every_s=0.1).run(said.append)
    assert line is not None and line.startswith("rendezvous timed out after 0.3 s: node(s) 1, 2 of 3 did not "
                                                "arrive (here: 0 (")
    assert said and "waiting for node(s) 1, 2 of 3" in said[0]

    store.put(KIND, 1, {"node_rank": 1, "host": "other", "rdzv_id": "megascope-b"})
    line = RollCall(store, 3, 0, "megascope-a", timeout_s=5, poll_s=0.05).run(said.append)
    assert line == ("node 1 (other) joined with rendezvous id 'megascope-b', this node has 'megascope-a': pass "
                    "the same --run-dir (or the same --rdzv-id) on every node")

    for rank in (1, 2):
        store.put(KIND, rank, {"node_rank": rank, "host": f"h{rank}", "rdzv_id": "megascope-a"})
    assert RollCall(store, 3, 0, "megascope-a", timeout_s=5, poll_s=0.05).run(said.append) is None
    del server


def test_a_node_is_lost_only_when_none_of_its_ranks_said_goodbye() -> None:
    beats = {0: {"host": "a", "status": "failed", "time": 1.0, "step": 9},
             1: {"host": "a", "status": "failed", "time": 1.0, "step": 9},
             2: {"host": "b", "status": "training", "time": 2.0, "step": 8},
             3: {"host": "b", "status": "training", "time": 3.0, "step": 9},
             4: {"host": "c", "status": "training", "time": 3.0, "step": 9},   # killed alone: a dead rank
             5: {"host": "c", "status": "failed", "time": 3.0, "step": 9}}
    assert lost_ranks(beats, "a") == {"b": [2, 3]}
    assert lost_ranks(beats, "b") == {}  # this node's own ranks are never a lost node
    incident, line = node_lost_incident(beats, {0: {"host": "a"}, 1: {"host": "b"}}, "a", 20, 40)
    assert incident["kind"] == "node_lost" and incident["ranks"] == [2, 3] and incident["nodes"] == [1]
    assert incident["step"] == 9 and incident["last_heartbeat"] == 3.0
    assert line.startswith("node 1 (b) lost: ranks 2, 3 ended without a final heartbeat")
    assert line.endswith("not back within --rdzv-timeout 20 s; to continue, run the same command with --resume "
                         "on every node from its checkpoint at step 40")
