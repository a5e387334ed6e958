"""Launch values from a scheduler's environment (trainer/scheduler_env.py): Slurm host lists expanded as
Slurm writes them, Slurm's and a Kubernetes indexed job's variables turned into node rank, node count and
endpoint with their sources, and every contradiction refused with one line, by the pure functions and
by the real `megascope train` command.

The expected expansions are what python-hostlist 2.3.0 (NSC's implementation of the LLNL/Slurm format)
gives for the same strings (checked once by hand, not a test dependency); where it is lenient (empty
entries, blanks) we refuse, as Slurm never writes those.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megascope.trainer.scheduler_env import (
    DEFAULT_PORT,
    MAX_HOSTS,
    SchedulerError,
    expand_hostlist,
    resolve_launch,
)

REPO = Path(__file__).resolve().parents[1]


def srun_env(nodelist: str, nnodes: int, node_id: int, tasks_per_node: int = 1, **extra: str) -> dict[str, str]:
    """The SLURM_* variables srun sets for the first task on node `node_id` of a step over every node of
    a job (the ones a launcher reads, and a few it must ignore)."""
    tasks = nnodes * tasks_per_node
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NAME": "exp7", "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NNODES": str(nnodes), "SLURM_JOB_NUM_NODES": str(nnodes), "SLURM_STEP_NUM_NODES": str(nnodes),
        "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nnodes})", "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id * tasks_per_node), "SLURM_LOCALID": "0", "SLURM_CPUS_ON_NODE": "2",
    }
    env.update(extra)
    return env


# ---- host lists ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
    ("node[8-10]", ["node8", "node9", "node10"]),          # the first number's width: no padding
    ("n[008-010]", ["n008", "n009", "n010"]),              # zero padding kept across the range
    ("x[001-003,7]", ["x001", "x002", "x003", "x7"]),      # each part its own width (hostlist.c, python-hostlist)
    ("node1", ["node1"]),
    ("c[1-2],login,d[09-11]", ["c1", "c2", "login", "d09", "d10", "d11"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("10.231.0.[1-2]", ["10.231.0.1", "10.231.0.2"]),
    ("node[1-1]", ["node1"]),
])
def test_slurm_host_lists_expand_in_order(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


def test_a_large_list_expands_and_one_past_the_bound_is_refused() -> None:
    hosts = expand_hostlist("gpu[00001-32768],cpu[1-32768]")
    assert len(hosts) == MAX_HOSTS and hosts[0] == "gpu00001" and hosts[-1] == "cpu32768"
    with pytest.raises(SchedulerError, match=f"more than {MAX_HOSTS} hosts"):
        expand_hostlist("a[0-65535]b[0-65535]")  # refused before 4 billion names are built
    with pytest.raises(SchedulerError, match=f"more than {MAX_HOSTS} hosts"):
        expand_hostlist("a[1-65536],b")


@pytest.mark.parametrize("text, why", [
    ("node[1-", r"a '\[' is not closed"),
    ("node]1", "nested or unbalanced"),
    ("node[[1]]", "nested or unbalanced"),
    ("node[3-1]", r"the range 3-1 in 'node\[3-1\]' runs backwards"),
    ("node[a-b]", r"'\[a-b\]' in 'node\[a-b\]' is not a list of numbers"),
    ("node[]", "is not a list of numbers"),
    ("node[-1]", "is not a list of numbers"),
    ("node[1--2]", "is not a list of numbers"),
    ("a,,b", "an empty entry"),
    ("a,", "an empty entry"),
    ("", "names no host"),
    ("a b", "a blank"),
])
def test_host_lists_that_cannot_be_parsed_say_why(text: str, why: str) -> None:
    with pytest.raises(SchedulerError, match=why):
        expand_hostlist(text)


# ---- Slurm -----------------------------------------------------------------------------------------

def test_slurm_gives_rank_count_and_endpoint_with_their_sources() -> None:
    place = resolve_launch(srun_env("node[01-04,07]", 5, 3), "node04")
    assert (place.nnodes, place.node_rank, place.endpoint, place.scheduler) == (5, 3, f"node01:{DEFAULT_PORT}",
                                                                               "slurm")
    assert place.line == ("[megascope] launch from Slurm: node rank 3 from SLURM_NODEID, 5 nodes from SLURM_NNODES, "
                          f"endpoint node01:{DEFAULT_PORT} from SLURM_JOB_NODELIST and the default port")


def test_the_port_comes_from_megascope_rdzv_port_then_master_port() -> None:
    env = srun_env("gpu-a[1-2],gpu-b3", 3, 0, MASTER_PORT="12345")
    assert resolve_launch(env, "gpu-a1").endpoint == "gpu-a1:12345"
    place = resolve_launch({**env, "MEGASCOPE_RDZV_PORT": "23456"}, "gpu-a1")
    assert place.endpoint == "gpu-a1:23456" and place.line.endswith("from SLURM_JOB_NODELIST and MEGASCOPE_RDZV_PORT")
    with pytest.raises(SchedulerError, match=r"MASTER_PORT='65535' is not a port 1..65534 \(the control store"):
        resolve_launch({**env, "MASTER_PORT": "65535"}, "gpu-a1")


def test_flags_that_agree_are_used_and_said() -> None:
    place = resolve_launch(srun_env("node[01-02]", 2, 1, MASTER_PORT="29500"), "node02", nnodes=2, node_rank=1,
                           endpoint="node01:29500")
    assert (place.nnodes, place.node_rank, place.endpoint) == (2, 1, "node01:29500")
    assert place.line == ("[megascope] launch from Slurm: node rank 1 from --node-rank (agrees with SLURM_NODEID), "
                          "2 nodes from --nnodes (agrees with SLURM_NNODES), endpoint node01:29500 from "
                          "--rdzv-endpoint (agrees with SLURM_JOB_NODELIST and MASTER_PORT)")
    # the port is the flag's when no variable names one (the default port is ours, not the scheduler's)
    assert resolve_launch(srun_env("node[01-02]", 2, 0), "node01", endpoint="node01:4000").endpoint == "node01:4000"


@pytest.mark.parametrize("flags, why", [
    ({"node_rank": 0}, "--node-rank 0 disagrees with SLURM_NODEID=1; drop the flag"),
    ({"nnodes": 4}, "--nnodes 4 disagrees with SLURM_NNODES=2; drop the flag"),
    ({"endpoint": "10.0.0.1:29400"}, "--rdzv-endpoint 10.0.0.1:29400 disagrees with SLURM_JOB_NODELIST: node 0 "
                                     "is node01 there"),
    ({"endpoint": "node01"}, "--rdzv-endpoint 'node01' is not HOST:PORT"),
])
def test_a_flag_that_disagrees_with_slurm_is_refused(flags: dict, why: str) -> None:
    with pytest.raises(SchedulerError) as exc:
        resolve_launch(srun_env("node[01-02]", 2, 1), "node02", **flags)
    assert str(exc.value).startswith(why) and "\n" not in str(exc.value)


def test_an_endpoint_port_that_disagrees_with_master_port_is_refused() -> None:
    with pytest.raises(SchedulerError, match="--rdzv-endpoint node01:4000 disagrees with MASTER_PORT=29500"):
        resolve_launch(srun_env("node[01-02]", 2, 1, MASTER_PORT="29500"), "node02", endpoint="node01:4000")


@pytest.mark.parametrize("env, why", [
    (srun_env("node[01-02]", 2, 2), r"node rank 2 \(SLURM_NODEID\) is outside 0..1 \(2 node\(s\) from SLURM_NNODES\)"),
    (srun_env("node[01-03]", 2, 0), r"SLURM_JOB_NODELIST='node\[01-03\]' names 3 host\(s\) but SLURM_NNODES=2"),
    (srun_env("node[01-02", 2, 0), r"SLURM_JOB_NODELIST='node\[01-02' cannot be parsed: a '\[' is not closed"),
    (srun_env("node[01-02]", 2, 0, tasks_per_node=8), r"srun started 16 tasks on 2 node\(s\) .*--ntasks-per-node=1"),
    (srun_env("node[01-02]", 2, 0, SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1"),
     "this srun step runs on 1 of the job's 2 nodes"),
    (srun_env("node[01-02]", 2, 0, SLURM_NODEID="x"), "SLURM_NODEID='x' is not a whole number >= 0"),
    (srun_env("node[01-02]", 2, 0, SLURM_NODEID="\u00b2"), "SLURM_NODEID='\u00b2' is not a whole number"),
    (srun_env("node[01-02]", 2, 0, SLURM_NNODES="0", SLURM_STEP_NUM_NODES=""), "SLURM_NNODES='0' is not a whole "
                                                                              "number >= 1"),
    # an salloc shell: the job's variables, no task of a step
    ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[01-02]"},
     r"Slurm's variables are set \(SLURM_NNODES, SLURM_JOB_NODELIST\) but not SLURM_NODEID: run megascope train "
     r"under srun, one task per node"),
    ({**srun_env("node[01-02]", 2, 0), "JOB_COMPLETION_INDEX": "0"},
     r"both Slurm \(SLURM_NODEID, SLURM_NNODES, SLURM_JOB_NODELIST\) and Kubernetes \(JOB_COMPLETION_INDEX\)"),
])
def test_slurm_contradictions_are_one_line(env: dict[str, str], why: str) -> None:
    with pytest.raises(SchedulerError, match=why) as exc:
        resolve_launch(env, "node01")
    assert "\n" not in str(exc.value) and "--scheduler" in str(exc.value)  # and what to do


def test_a_missing_slurm_value_can_come_from_its_flag() -> None:
    env = {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[01-02]"}
    place = resolve_launch(env, "node02", node_rank=1)
    assert (place.nnodes, place.node_rank, place.endpoint) == (2, 1, f"node01:{DEFAULT_PORT}")
    assert "node rank 1 from --node-rank, 2 nodes from SLURM_NNODES" in place.line


def test_one_slurm_node_meets_locally() -> None:
    place = resolve_launch(srun_env("gpu17", 1, 0), "gpu17")
    assert (place.nnodes, place.node_rank, place.endpoint) == (1, 0, "")  # launch picks 127.0.0.1 and a free port
    assert place.line == ("[megascope] launch from Slurm: node rank 0 from SLURM_NODEID, 1 node from SLURM_NNODES, "
                          "a local rendezvous (one node)")


def test_scheduler_none_and_no_scheduler_leave_the_flags_alone() -> None:
    assert resolve_launch({}, "h") == resolve_launch(srun_env("n[1-2]", 2, 1), "h", scheduler="none")
    place = resolve_launch(srun_env("n[1-2]", 2, 1), "h", nnodes=3, node_rank=2, endpoint="a:1", scheduler="none")
    assert (place.nnodes, place.node_rank, place.endpoint, place.line) == (3, 2, "a:1", "")
    assert (resolve_launch({}, "h").nnodes, resolve_launch({}, "h").node_rank) == (1, 0)
    picked = resolve_launch({**srun_env("n[1-2]", 2, 1), "JOB_COMPLETION_INDEX": "0"}, "h", scheduler="slurm")
    assert picked.node_rank == 1 and picked.scheduler == "slurm"


# ---- Kubernetes ------------------------------------------------------------------------------------

K8S = {"JOB_COMPLETION_INDEX": "2", "MEGASCOPE_K8S_NNODES": "4", "MEGASCOPE_K8S_SERVICE": "exp7-nodes",
       "KUBERNETES_SERVICE_HOST": "10.96.0.1"}


def test_kubernetes_indexed_job_gives_pod_zeros_dns_name() -> None:
    place = resolve_launch(K8S, "exp7-2")
    assert (place.nnodes, place.node_rank, place.endpoint, place.scheduler) == (4, 2, "exp7-0.exp7-nodes:29400",
                                                                               "kubernetes")
    assert place.line == ("[megascope] launch from Kubernetes: node rank 2 from JOB_COMPLETION_INDEX, 4 nodes from "
                          "MEGASCOPE_K8S_NNODES, endpoint exp7-0.exp7-nodes:29400 from the pod's hostname with "
                          "MEGASCOPE_K8S_SERVICE and the default port")
    # a job name with dashes and digits of its own: only the trailing -<index> goes
    assert resolve_launch({**K8S, "JOB_COMPLETION_INDEX": "12", "MEGASCOPE_K8S_NNODES": "16"},
                          "llm-70b-run-3-12").endpoint == "llm-70b-run-3-0.exp7-nodes:29400"


def test_kubernetes_node_count_from_the_flag() -> None:
    env = {k: v for k, v in K8S.items() if k != "MEGASCOPE_K8S_NNODES"}
    assert resolve_launch(env, "exp7-2", nnodes=4).line.split(", ")[1] == "4 nodes from --nnodes"


@pytest.mark.parametrize("change, why", [
    ({"MEGASCOPE_K8S_NNODES": None}, "needs the node count: set MEGASCOPE_K8S_NNODES to the Job's completions, "
                                     "or pass --nnodes"),
    ({"MEGASCOPE_K8S_SERVICE": None}, "needs the headless Service that is the pods' subdomain: set "
                                      "MEGASCOPE_K8S_SERVICE"),
    ({"MEGASCOPE_K8S_SERVICE": "Exp7_nodes"}, "MEGASCOPE_K8S_SERVICE='Exp7_nodes' is not a Service name"),
    ({"JOB_COMPLETION_INDEX": "4"}, r"node rank 4 \(JOB_COMPLETION_INDEX\) is outside 0..3"),
    ({"JOB_COMPLETION_INDEX": "-1"}, "JOB_COMPLETION_INDEX='-1' is not a whole number >= 0"),
])
def test_kubernetes_contradictions_are_one_line(change: dict, why: str) -> None:
    env = {k: v for k, v in {**K8S, **change}.items() if v is not None}
    with pytest.raises(SchedulerError, match=why):
        resolve_launch(env, f"exp7-{env['JOB_COMPLETION_INDEX']}")


def test_a_pod_not_named_job_index_needs_the_endpoint_flag() -> None:
    with pytest.raises(SchedulerError, match=r"the hostname 'trainer-abcde' is not <job>-2.*pass --rdzv-endpoint"):
        resolve_launch(K8S, "trainer-abcde")
    assert resolve_launch(K8S, "trainer-abcde", endpoint="10.1.2.3:29400").endpoint == "10.1.2.3:29400"
    with pytest.raises(SchedulerError, match="--rdzv-endpoint other-0.exp7-nodes:29400 disagrees with the pod's "
                                             "hostname with MEGASCOPE_K8S_SERVICE: node 0 is exp7-0.exp7-nodes"):
        resolve_launch(K8S, "exp7-2", endpoint="other-0.exp7-nodes:29400")


# ---- the command -----------------------------------------------------------------------------------

def train(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("SLURM_") and k != "JOB_COMPLETION_INDEX"}
    return subprocess.run([sys.executable, "-m", "megascope.cli", "train", "--preset", "tiny", *argv],
                          env={**clean, **env}, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("env, argv, line", [
    (srun_env("node[01-02]", 2, 1), ["--node-rank", "0"],
     "megascope train: --node-rank 0 disagrees with SLURM_NODEID=1; drop the flag (the scheduler's value is used), "
     "or pass --scheduler none to use the launch flags alone"),
    (srun_env("node[01-02", 2, 1), [],
     "megascope train: SLURM_JOB_NODELIST='node[01-02' cannot be parsed: a '[' is not closed; pass --scheduler "
     "none and the launch flags (--nnodes, --node-rank, --rdzv-endpoint) instead"),
])
def test_train_refuses_a_contradiction_with_one_line(env: dict[str, str], argv: list[str], line: str,
                                                     tmp_path: Path) -> None:
    done = train(env, "--run-dir", str(tmp_path / "r"), *argv)
    assert done.returncode == 2 and done.stderr.strip() == line and done.stdout == "", done.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # refused before anything was made


def test_train_help_names_the_scheduler_variables() -> None:
    done = subprocess.run([sys.executable, "-m", "megascope.cli", "train", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    for needle in ("--scheduler {auto,slurm,kubernetes,none}", "(default: 1, or SLURM_NNODES / MEGASCOPE_K8S_NNODES)",
                   "(default: 0, or SLURM_NODEID / JOB_COMPLETION_INDEX)", "$MASTER_PORT, else 29400)",
                   "docs/schedulers.md"):
        assert needle in text, needle
