"""Driver side of `megascope train`: start dp*tp*pp ranks through torch.distributed's elastic launcher.

The elastic agent (the machinery behind torchrun) does rendezvous, process start, monitoring and
teardown; Ctrl-C reaches it as SIGINT and it stops every rank. With restarts allowed
(--max-restarts or robust.max_restarts) the agent restarts the whole worker group after a failure and
the workers resume from the latest complete checkpoint. Next to the agent, a supervisor thread
(trainer/robust/supervisor.py) watches the ranks' heartbeats for silent ranks and stalls and stops the group.
The launch values (--nnodes, --node-rank, --rdzv-endpoint) arrive settled with a scheduler's variables
(trainer/scheduler_env.py, through trainer/cli.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from megascope.tracer.run_dir import run_entries
from megascope.trainer.config import JobConfig
from megascope.trainer.object_store import upload_leftovers, use_url_run_dir
from megascope.trainer.robust.checkpoint import (
    CheckpointLayoutError,
    check_resumable,
    checkpoint_home,
    latest_complete_at,
)
from megascope.trainer.robust.heartbeat import heartbeat_dir, read_heartbeats
from megascope.trainer.robust.node_loss import node_lost_incident
from megascope.trainer.robust.preflight import check_data, check_device, check_run_dir
from megascope.trainer.robust.roll_call import KIND as ROLL_CALL
from megascope.trainer.robust.roll_call import RollCall, rendezvous_id
from megascope.trainer.robust.stop_guard import StopGuard
from megascope.trainer.robust.supervisor import ControlPlaneHost, Supervisor, append_incident, process_alive
from megascope.trainer.watch_child import WatchChild


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: JobConfig, args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from megascope.trainer.worker import worker_main

    nnodes = args.nnodes
    if cfg.world_size % nnodes:
        print(f"megascope train: world size {cfg.world_size} (dp*tp*pp) is not divisible by "
              f"--nnodes {nnodes}", file=sys.stderr)
        return 2
    nproc = args.nproc_per_node or cfg.world_size // nnodes
    if nproc * nnodes != cfg.world_size:
        print(f"megascope train: --nproc-per-node {nproc} x --nnodes {nnodes} != dp*tp*pp = "
              f"{cfg.world_size}; change the layout or the launch flags", file=sys.stderr)
        return 2
    if nnodes > 1 and not args.rdzv_endpoint:
        print("megascope train: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node: "
              "node 0's address and a free port)", file=sys.stderr)
        return 2
    if nnodes > 1 and not cfg.run_dir:
        print(f"megascope train: --nnodes {nnodes} needs --run-dir RUN, the same on every node (a shared folder "
              "or an s3:// URL): every node writes there, and the nodes meet under an id derived from it",
              file=sys.stderr)
        return 2
    if not args.rdzv_timeout > 0:
        print(f"megascope train: --rdzv-timeout {args.rdzv_timeout:g} must be > 0 seconds", file=sys.stderr)
        return 2
    if not 0 <= args.node_rank < nnodes:
        print(f"megascope train: --node-rank {args.node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})",
              file=sys.stderr)
        return 2
    if args.resume and not cfg.run_dir:
        print("megascope train: --resume needs --run-dir RUN, the run to continue", file=sys.stderr)
        return 2
    cfg.run_dir = cfg.run_dir or default_run_dir()
    rdzv_id = rendezvous_id(args.rdzv_id, cfg.run_dir)  # from the run directory as given, before a URL's scratch
    joining = args.node_rank > 0  # node 0 checks the run directory for the job; the roll call checks the nodes
    url, problem = use_url_run_dir(cfg, args.resume, joining)  # s3://...: trace to the store, the rest to local scratch
    if problem:
        print(f"megascope train: {problem}", file=sys.stderr)
        return 2
    problem = (check_run_dir(cfg.run_dir, args.resume, joining)
               or check_device(cfg.train.device, nproc, share_gpus=cfg.train.backend == "gloo")
               or check_data(cfg.data.path, cfg.model.seq_len) or check_resume(cfg, args.resume))
    if problem:
        print(f"megascope train: {problem}", file=sys.stderr)
        return 2
    try:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"megascope train: cannot create --run-dir {cfg.run_dir} ({exc.strerror}); pass another path",
              file=sys.stderr)
        return 2
    warn_stall_timeout(cfg)
    if args.resume and not joining:
        start_resumed_launch(cfg)
    max_restarts = cfg.robust.max_restarts
    endpoint = args.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
    # torch's agent keeps per-attempt folders (empty: no output is redirected) under a mkdtemp of its own
    # that it never removes, one /tmp/torchelastic_* per launch; this one goes when the job ends
    agent_dir = tempfile.TemporaryDirectory(prefix="megascope-agent-")
    launch_cfg = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
        run_id=rdzv_id, rdzv_backend=args.rdzv_backend, rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs(args.rdzv_backend, args.node_rank, args.rdzv_timeout),
        max_restarts=max_restarts, monitor_interval=0.2, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=agent_dir.name),
    )
    # Each rank gets an even share of this node's cores (2 cores, 8 ranks -> 1 thread each).
    threads = max(1, (os.cpu_count() or 1) // nproc)
    print(f"[megascope] launching {cfg.world_size} ranks (dp={cfg.parallel.dp} tp={cfg.parallel.tp} "
          f"pp={cfg.parallel.pp} vpp={cfg.parallel.vpp}) -> {url or cfg.run_dir}{node_text(args, rdzv_id, endpoint)}; "
          f"recovery: {recovery_text(cfg)}",
          flush=True)
    if nnodes > 1:
        # Each rendezvous round gets a fresh store that the round's rank 0 hosts (env:// in the workers).
        # torch 2.13's shared agent store (the default) never republishes MASTER_ADDR for a later round
        # when its rank 0 is a node that survived: a node started again after a node loss waited for it
        # 60 s and both sides failed (measured in namespaces, tests/test_multinode.py).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    guard = StopGuard().install()  # a stop signal ends this process within seconds, blocked or not
    code = run_job(cfg, args, url, endpoint, rdzv_id,
                   lambda: elastic_launch(launch_cfg, worker_main)(cfg.to_dict(), threads))
    guard.close()
    agent_dir.cleanup()
    if guard.signum is not None:  # stopped: the job's cleanup is done; leave no thread or child behind
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_job(cfg: JobConfig, args: argparse.Namespace, url: str | None, endpoint: str, rdzv_id: str,
            run_ranks: Callable[[], object]) -> int:
    """The driver's side of the job around the elastic agent: watcher, control store, roll call of the
    nodes, supervisor; every one of them closed however the agent ends."""
    nnodes = args.nnodes
    watcher = start_watcher(url or cfg.run_dir, getattr(args, "watch_argv", None), args.node_rank)
    control = ControlPlaneHost(nnodes, args.node_rank, endpoint)  # heartbeats and hang records, no shared FS
    code = 2
    supervisor: Supervisor | None = None
    try:
        problem = roll_call(control, nnodes, args.node_rank, rdzv_id, args.rdzv_timeout) if nnodes > 1 else None
        if problem:
            print(f"megascope train: {problem}", file=sys.stderr)
            return code
        supervisor = Supervisor(cfg.run_dir, cfg.robust, cfg.world_size, cfg.robust.max_restarts,
                                store=control.client, leader=args.node_rank == 0,
                                restart_note=restart_note(nnodes, args.rdzv_timeout)).start()
        lost = lambda: lost_node_line(cfg, supervisor, control, args.rdzv_timeout)  # noqa: E731
        code = run_agent(cfg, supervisor, run_ranks, lost)
    finally:
        if supervisor is not None:
            supervisor.stop(persist=args.node_rank == 0)
        control.close()
        if url and args.node_rank == 0 and supervisor is not None:  # node 0's supervisor holds the job's view
            upload_leftovers(cfg.run_dir, url)
        if watcher is not None:  # after the ranks: the watcher's final verdict needs their last flush
            watcher.stop(job_finished=code == 0)
    return code


def restart_note(nnodes: int, timeout_s: float) -> str:
    """What a restart on several nodes waits for, said with the failure (torch's rendezvous is silent)."""
    if nnodes == 1:
        return ""
    return (f" once all {nnodes} nodes are back in the rendezvous (waiting up to --rdzv-timeout {timeout_s:g} s; "
            "a lost node rejoins when started again with the same command)")


def lost_node_line(cfg: JobConfig, supervisor: Supervisor, control: ControlPlaneHost, timeout_s: float) -> str:
    """After the rendezvous timed out waiting for a lost node: the node_lost incident, and its line."""
    nodes = (control.client.get_all(ROLL_CALL) if control.client is not None else None) or {}
    info = latest_complete_at(checkpoint_home(cfg))
    incident, line = node_lost_incident(supervisor.beats, nodes, socket.gethostname(), timeout_s,
                                        info.step if info is not None else None)
    if supervisor.leader:  # node 0 records it; every surviving node says it
        append_incident(cfg.run_dir, incident)
    return line


def rdzv_configs(backend: str, node_rank: int, timeout_s: float) -> dict[str, object]:
    """torch's rendezvous settings: static needs this node's rank; both wait at most --rdzv-timeout
    (c10d: for the nodes at the first rendezvous and again after a node is lost)."""
    if backend == "static":
        return {"rank": node_rank, "timeout": int(timeout_s)}
    return {"join_timeout": int(timeout_s)} if backend == "c10d" else {}


def node_text(args: argparse.Namespace, rdzv_id: str, endpoint: str) -> str:
    """The startup line's account of a multi-node launch, to compare across nodes."""
    if args.nnodes == 1:
        return ""
    return (f"; node {args.node_rank} of {args.nnodes} ({socket.gethostname()}), {args.rdzv_backend} rendezvous "
            f"'{rdzv_id}' at {endpoint}")


def roll_call(control: ControlPlaneHost, nnodes: int, node_rank: int, rdzv_id: str, timeout_s: float) -> str | None:
    """Wait for every node at the control store (trainer/robust/roll_call.py); one line when one is missing."""
    if control.client is None:
        return None  # no store (said by ControlPlaneHost): torch's rendezvous alone
    return RollCall(control.client, nnodes, node_rank, rdzv_id, timeout_s).run(lambda line: print(line, flush=True))


def start_watcher(run_dir: str, watch_argv: list[str] | None, node_rank: int) -> WatchChild | None:
    """`megascope train --watch`: the watcher beside the job, one per job (on node 0: the run
    directory is shared), started before the ranks (it waits for run.json)."""
    if watch_argv is None or node_rank != 0:
        return None
    child = WatchChild(run_dir, watch_argv).start()
    print(f"[megascope] watching {run_dir} live: findings on stdout and in {run_dir}/findings.jsonl", flush=True)
    return child


def run_agent(cfg: JobConfig, supervisor: Supervisor, run_ranks: Callable[[], object],
              lost_node: Callable[[], str] | None = None) -> int:
    """Run the elastic agent (`run_ranks`); the job's exit code, its failure recorded as an incident.
    `lost_node`: the line (and incident) for a rendezvous that timed out waiting for a lost node."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError

    max_restarts = cfg.robust.max_restarts
    try:
        run_ranks()
    except RendezvousTimeoutError:
        line = lost_node() if lost_node is not None else "the rendezvous timed out"
        print(f"megascope train: {line}", file=sys.stderr)
        return 1
    except RendezvousError as exc:
        append_incident(cfg.run_dir, {"kind": "rendezvous_failed", "ranks": [], "detail": repr(exc)})
        print(f"megascope train: the rendezvous failed ({type(exc).__name__}: {exc or 'no detail'}); node 0, "
              "which hosts it, may be gone: to continue, run the same command with --resume on every node",
              file=sys.stderr)
        return 1
    except ChildFailedError as exc:
        failed_rank, first = next(iter(exc.failures.items()))
        append_incident(cfg.run_dir, {"kind": "job_failed", "ranks": [failed_rank],
                                      "detail": f"rank {failed_rank} failed (exit code {first.exitcode}) "
                                                f"with {max_restarts} restart(s) allowed"})
        print(f"megascope train: rank {failed_rank} failed (exit code {first.exitcode}); "
              f"trace so far is in {cfg.run_dir}; incidents: {cfg.run_dir}/incidents.jsonl", file=sys.stderr)
        return 1
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:  # Ctrl-C reaches the agent as a signal; it has stopped every rank
            append_incident(cfg.run_dir, {"kind": "interrupted", "ranks": [], "detail": "Ctrl-C (SIGINT)"})
            print(f"\nmegascope train: interrupted; all ranks stopped; trace so far is in {cfg.run_dir}",
                  file=sys.stderr)
            return 130
        stopped_by_check = any(i["kind"] == "self_check" for i in supervisor.incidents)
        why = "stopped after a failed self-check" if stopped_by_check else f"stopped by signal {exc.sigval}"
        print(f"megascope train: {why}; see {cfg.run_dir}/incidents.jsonl and {cfg.run_dir}/self_check/",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nmegascope train: interrupted; all ranks stopped; trace so far is in {cfg.run_dir}",
              file=sys.stderr)
        return 130
    return 0


def recovery_text(cfg: JobConfig) -> str:
    """The startup line's account of what happens after a failure."""
    r = cfg.robust
    if r.checkpoint_every == 0 and r.max_restarts == 0:
        return "off (no checkpoints, no automatic restart: a failure ends the job)"
    every = {0: "no checkpoints", -1: f"a checkpoint every ~{r.checkpoint_interval_s:g} s of training"}.get(
        r.checkpoint_every, f"a checkpoint every {r.checkpoint_every} steps")
    restarts = "no automatic restart" if not r.max_restarts else f"up to {r.max_restarts} automatic restart(s)" + (
        " from the latest checkpoint" if r.checkpoint_every else "")
    return f"{every}, {restarts} (--checkpoint-every 0 --max-restarts 0 turn it off)"


def warn_stall_timeout(cfg: JobConfig) -> None:
    r = cfg.robust
    if 0 < r.stall_timeout_s <= cfg.trace.hang_timeout_s and cfg.trace.enabled:
        print(f"[megascope] warning: robust.stall_timeout_s ({r.stall_timeout_s}) <= trace.hang_timeout_s "
              f"({cfg.trace.hang_timeout_s}): a hang is stopped before the in-flight records that name "
              "the hung rank are written", file=sys.stderr)


def check_resume(cfg: JobConfig, resume: bool) -> str | None:
    """With --resume: a complete checkpoint of the same layout, and no job of the run still alive.
    (Without it, check_run_dir has made sure the directory holds no run, so no checkpoint either.)"""
    if not resume:
        return None
    if not run_entries(cfg.run_dir):
        print(f"[megascope] --resume: {cfg.run_dir} holds no run yet: starting a new one", flush=True)
        return None
    live = {r: b for r, b in read_heartbeats(cfg.run_dir).items()
            if b.get("host") == socket.gethostname() and b.get("status") not in ("done", "failed")
            and process_alive(int(b.get("pid", 0)))}
    if live:
        rank, beat = min(live.items())
        return (f"--resume: a job is still running in {cfg.run_dir} (rank {rank}, pid {beat['pid']}); "
                "stop it first (Ctrl-C in its terminal)")
    problems: list[str] = []
    info = latest_complete_at(checkpoint_home(cfg), problems=problems)
    if info is None:
        damage = f"; damaged: {'; '.join(problems)}" if problems else ""
        return (f"--resume: {cfg.run_dir} has no complete checkpoint to continue from (checkpoints were off, "
                f"or the run ended before its first one){damage}; pass a new --run-dir")
    for problem in problems:  # a newer one is damaged: said, and the newest complete one is used
        print(f"[megascope] --resume: skipping a damaged checkpoint: {problem}", flush=True)
    try:
        check_resumable(info, cfg)
    except CheckpointLayoutError as exc:
        return str(exc)
    return None


def start_resumed_launch(cfg: JobConfig) -> None:
    """A new launch continuing a run: the previous launch's heartbeats and health view go (the
    supervisor would take their pids for dead ranks of this launch), and a `restart` incident marks
    where the new attempt begins, so the analyzer keeps only its rows of the steps run again."""
    info = latest_complete_at(checkpoint_home(cfg))
    if info is None:
        return
    shutil.rmtree(heartbeat_dir(cfg.run_dir), ignore_errors=True)
    (Path(cfg.run_dir) / "health.json").unlink(missing_ok=True)
    append_incident(cfg.run_dir, {"kind": "restart", "attempt": 0, "ranks": [], "step": info.step,
                                  "detail": f"megascope train --resume: a new launch continues the run "
                                            f"from its checkpoint at step {info.step}"})
    print(f"[megascope] --resume: continuing {cfg.run_dir} from its checkpoint at step {info.step}", flush=True)
