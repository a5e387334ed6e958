"""`megascope train`: resolve the config (defaults < preset < TOML < flags), validate, launch."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from megascope.trainer.config import ConfigError, JobConfig, apply_overrides, load_toml, validate
from megascope.trainer.config_docs import field_docs
from megascope.trainer.presets import PRESETS, preset
from megascope.trainer.robust.faults import FaultSpec, FaultSpecError, parse_specs
from megascope.trainer.scheduler_env import DEFAULT_PORT, SCHEDULERS, resolve_launch

# flag -> (section, field); every flag defaults to None so only flags the user gave override.
FLAGS: dict[str, tuple[str, str, type]] = {
    "--dp": ("parallel", "dp", int),
    "--tp": ("parallel", "tp", int),
    "--pp": ("parallel", "pp", int),
    "--vpp": ("parallel", "vpp", int),
    "--steps": ("train", "steps", int),
    "--seed": ("train", "seed", int),
    "--global-batch": ("train", "global_batch", int),
    "--micro-batch": ("train", "micro_batch", int),
    "--lr": ("train", "lr", float),
    "--optimizer": ("train", "optimizer", str),
    "--device": ("train", "device", str),
    "--dtype": ("train", "dtype", str),
    "--layers": ("model", "n_layers", int),
    "--hidden": ("model", "hidden", int),
    "--heads": ("model", "n_heads", int),
    "--seq-len": ("model", "seq_len", int),
    "--window": ("model", "window", int),
    "--parallel-block": ("model", "parallel_block", str),
    "--zero": ("parallel", "zero", str),
    "--sequence-parallel": ("parallel", "sequence_parallel", str),
    "--scatter-gather": ("parallel", "scatter_gather", str),
    "--recompute": ("parallel", "recompute", str),
    "--data": ("data", "path", str),
    "--trace": ("trace", "enabled", str),
    "--trace-level": ("trace", "level", str),
    "--checkpoint-every": ("robust", "checkpoint_every", int),
    "--max-restarts": ("robust", "max_restarts", int),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a GPT with dp x tp x pp parallelism, traced into a run directory",
        description="Train a GPT with tensor, pipeline and data parallelism (world = dp*tp*pp), "
                    "launched through torch.distributed's elastic launcher; every rank streams its "
                    "trace into the run directory. Settings: defaults < --preset < --config < flags "
                    "(the defaults shown are the config's own, before a --preset).",
        epilog="All config fields: docs/config.md. Faults: docs/faults.md.")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with [model] [parallel] [train] [data] [trace]")
    p.add_argument("--preset", choices=sorted(PRESETS), help="named starting point (tiny runs in seconds on a CPU)")
    p.add_argument("--run-dir", help="where the trace and run.json go; must be new or empty unless --resume "
                                     "(default: runs/<timestamp>); an object-store URL (s3://bucket/prefix) takes "
                                     "the trace, and checkpoints and other local files go to a scratch folder under "
                                     "$MEGASCOPE_CACHE_DIR (default ~/.cache/megascope)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its latest complete checkpoint (same layout); "
                        "a directory without a run starts a new one")
    p.add_argument("--inject", action="append", default=None, metavar="SPEC",
                   help="fault to inject, repeatable: straggler:rank=R,slowdown=X[,from=S][,to=S] | "
                        "late_launch:rank=R,ms=M[,every=K] | flap:ranks=A-B,down_ms=D,period_steps=P | "
                        "hang:rank=R,at=S | crash:rank=R,at=S")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config field, e.g. --set trace.flush_interval_s=1")
    docs = field_docs()
    defaults = JobConfig()
    for flag, (section, name, kind) in FLAGS.items():
        help_kind = "on|off" if kind is str and name in _BOOL_FIELDS else kind.__name__.upper()
        doc = docs[type(getattr(defaults, section)).__name__].get(name, "")
        default = _shown(getattr(getattr(defaults, section), name))
        # flags default to None (only the ones given override); the config default is shown instead
        p.add_argument(flag, type=kind, default=None, metavar=help_kind,
                       help=f"[{section}.{name}] {doc} (default: {default})".replace("%", "%%"))
    watch = p.add_argument_group("live diagnosis (docs/watch.md)")
    watch.add_argument("--watch", action="store_true",
                       help="start `megascope watch RUN` beside the job: findings on stdout and in "
                            "RUN/findings.jsonl as they appear; it gives the final verdict when the job "
                            "finishes and is stopped when the job fails; a watcher failure never stops training")
    watch.add_argument("--watch-args", default="", metavar="'ARGS'",
                       help="options for the watcher (implies --watch), split like a shell line, e.g. "
                            "--watch-args='--webhook http://127.0.0.1:9000/hook --metrics-port 9464' "
                            "(write it with '=' when ARGS start with '-'); see `megascope watch --help`")
    launch = p.add_argument_group(
        "launch (torch.distributed elastic; several hosts: docs/several-hosts.md; schedulers: "
        "docs/schedulers.md)",
        "On several nodes run the same command on each, with the same --run-dir and --rdzv-endpoint and "
        "its own --node-rank; node 0 runs on the --rdzv-endpoint host and also hosts the control store "
        "on the rendezvous port + 1. Under Slurm (srun, one task per node) or in a Kubernetes Indexed Job "
        "the flags --nnodes, --node-rank and --rdzv-endpoint may be left out: the scheduler's variables give "
        "them (the first line says which); a flag given anyway must agree with them.")
    launch.add_argument("--nnodes", type=int, default=None,
                        help="number of nodes (default: 1, or SLURM_NNODES / MEGASCOPE_K8S_NNODES)")
    launch.add_argument("--node-rank", type=int, default=None,
                        help="this node's index 0..nnodes-1, with either rendezvous backend; node 0 must run "
                             "on the --rdzv-endpoint host (default: 0, or SLURM_NODEID / JOB_COMPLETION_INDEX)")
    launch.add_argument("--scheduler", default="auto", choices=list(SCHEDULERS),
                        help="where the launch values come from when the flags are absent: auto reads Slurm's "
                             "or a Kubernetes indexed job's variables when set (both set: refused), none the "
                             "flags alone (default: auto)")
    launch.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (default: world/nnodes)")
    launch.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "static"],
                        help="rendezvous backend: c10d lets a lost node be replaced by starting it again, "
                             "static fixes the nodes (default: c10d)")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="node 0's address and a free port, the same on every node (required with "
                             "--nnodes > 1; PORT + 1 must be free too, for the control store; default: under "
                             "a scheduler node 0's host (the first of SLURM_JOB_NODELIST, or <job>-0."
                             "$MEGASCOPE_K8S_SERVICE) and $MEGASCOPE_RDZV_PORT, else $MASTER_PORT, else "
                             f"{DEFAULT_PORT})")
    launch.add_argument("--rdzv-id", default="", metavar="ID",
                        help="job id shared by all nodes (default: megascope-NAME, NAME the last part of "
                             "--run-dir: the same on every node that passes the same --run-dir)")
    launch.add_argument("--rdzv-timeout", type=float, default=300, metavar="SECONDS",
                        help="how long a node waits for the others, at the start and after a node is lost, "
                             "before it stops with one line naming the nodes that did not arrive (default: 300)")

_BOOL_FIELDS = {"parallel_block", "zero", "sequence_parallel", "scatter_gather", "enabled"}


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value) if value == "" else str(value)


def parse_set(items: list[str]) -> dict[str, dict[str, str]]:
    """`--set SECTION.KEY=VALUE` items as {section: {key: value}} (values typed later by apply_overrides)."""
    overrides: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not eq or not dot:
            raise ConfigError(f"--set '{item}': expected SECTION.KEY=VALUE, e.g. train.lr=1e-3")
        overrides.setdefault(section, {})[name] = value
    return overrides


def resolve_config(args: argparse.Namespace) -> JobConfig:
    """defaults < preset < TOML < flags < --set, then validate (before any process starts)."""
    cfg = JobConfig()
    if args.preset:
        apply_overrides(cfg, preset(args.preset), source=f"preset {args.preset}")
    if args.config:
        load_toml(cfg, args.config)
    overrides: dict[str, dict] = {}
    for flag, (section, name, _) in FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.setdefault(section, {})[name] = value
    for section, values in parse_set(args.set).items():
        overrides.setdefault(section, {}).update(values)
    apply_overrides(cfg, overrides, source="command line")
    if args.run_dir:
        cfg.run_dir = args.run_dir
    if args.inject is not None:
        cfg.inject = list(args.inject)
    validate(cfg)
    check_fault_steps(parse_specs(cfg.inject, cfg.world_size), cfg.train.steps)
    return cfg


def check_fault_steps(specs: list[FaultSpec], steps: int) -> None:
    """Numbers a fault needs beyond its syntax (faults.parse_spec): steps inside the run, positive
    delays. A hang at step -3 or past the last step would never fire, and the run would look clean."""
    for spec in specs:
        p, where = spec.params, f"--inject '{spec.text}'"
        for key in ("at", "from", "to", "every", "period_steps"):
            if key in p and (p[key] != int(p[key]) or p[key] < 0):
                raise FaultSpecError(f"{where}: {key}={p[key]:g} must be a step count >= 0 (a whole number)")
        for key in ("at", "from"):
            if key in p and p[key] >= steps:
                raise FaultSpecError(f"{where}: {key}={p[key]:g} is past the last step ({steps - 1}); "
                                     f"the run has steps 0..{steps - 1}: lower it or raise --steps")
        if p.get("from", 0) > p.get("to", float("inf")):
            raise FaultSpecError(f"{where}: from={p['from']:g} is after to={p['to']:g}")
        for key in ("ms", "down_ms", "every", "slowdown"):
            if key in p and not 0 < p[key] < float("inf"):
                raise FaultSpecError(f"{where}: {key}={p[key]:g} must be a positive number")


def watch_args(args: argparse.Namespace) -> list[str] | None:
    """The watcher's options (None: no --watch); ValueError with one line when `megascope watch` would
    refuse them, so a typo fails here and not minutes into the job."""
    if not args.watch and not args.watch_args:
        return None
    from megascope.trainer.watch_child import parse_watch_args

    extra = parse_watch_args(args.watch_args)
    # the watcher's own parser and checks (the analyzer is needed for --watch anyway: the watcher runs on it)
    from megascope.analyzer.watch.cli import add_parser as add_watch_parser
    from megascope.analyzer.watch.cli import check_args

    class _Refused(argparse.ArgumentParser):
        def error(self, message: str):
            raise ValueError(f"--watch-args '{args.watch_args}': {message}")

    sub = _Refused(prog="megascope", add_help=False).add_subparsers(parser_class=_Refused)
    parsed = add_watch_parser(sub).parse_args(["RUN", *extra])
    problem = check_args(parsed)
    if problem:
        raise ValueError(f"--watch-args '{args.watch_args}': {problem}")
    return extra


def launch_place(args: argparse.Namespace) -> str:
    """--nnodes, --node-rank and --rdzv-endpoint settled with the scheduler's variables (SchedulerError,
    a ValueError, with one line on a contradiction); returns the line saying where each came from ("" when
    no scheduler is involved)."""
    place = resolve_launch(os.environ, socket.gethostname(), args.nnodes, args.node_rank, args.rdzv_endpoint,
                           args.scheduler)
    args.nnodes, args.node_rank, args.rdzv_endpoint = place.nnodes, place.node_rank, place.endpoint
    return place.line


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve_config(args)
        args.watch_argv = watch_args(args)
        where = launch_place(args)
    except (ConfigError, FaultSpecError, KeyError, ValueError) as exc:
        print(f"megascope train: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if where:
        print(where, flush=True)
    from megascope.trainer.launch import launch  # torch import deferred until the config is known good

    return launch(cfg, args)
