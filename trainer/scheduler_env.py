"""Where `megascope train` runs, as a scheduler says it: node rank, node count and rendezvous endpoint
from Slurm's or a Kubernetes indexed Job's environment, each value with the variable it came from.

Pure functions (an environment and a hostname in, values or one error line out); docs/schedulers.md
says which variables are read and what a flag that disagrees with them does (it is refused: a flag
wins only when it agrees, so nodes never meet at two different places).

    Slurm (srun, one task per node)     node rank SLURM_NODEID, node count SLURM_NNODES,
                                        endpoint host: the first host of SLURM_JOB_NODELIST
    Kubernetes (Indexed Job)            node rank JOB_COMPLETION_INDEX, node count MEGASCOPE_K8S_NNODES,
                                        endpoint host: <job>-0.<MEGASCOPE_K8S_SERVICE>, <job> the pod's
                                        hostname (<job>-<index>) less its index
    endpoint port (both)                MEGASCOPE_RDZV_PORT, else MASTER_PORT, else 29400
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Generic, Mapping, TypeVar

T = TypeVar("T")

DEFAULT_PORT = 29400
"""The rendezvous port when no variable names one (torchrun's default); the control store takes it + 1."""
SLURM_VARS = ("SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NODELIST")
K8S_INDEX = "JOB_COMPLETION_INDEX"
K8S_NNODES = "MEGASCOPE_K8S_NNODES"
K8S_SERVICE = "MEGASCOPE_K8S_SERVICE"
PORT_VARS = ("MEGASCOPE_RDZV_PORT", "MASTER_PORT")
SCHEDULERS = ("auto", "slurm", "kubernetes", "none")
MAX_HOSTS = 65536
"""Slurm's own bound on one range (hostlist.c MAX_RANGE); a list expanding past it is refused, not built."""
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123, what a Service name must be
_OR_NONE = ", or pass --scheduler none to use the launch flags alone"
_USE_NONE = "; pass --scheduler none and the launch flags (--nnodes, --node-rank, --rdzv-endpoint) instead"


class SchedulerError(ValueError):
    """One line: what in the scheduler's variables (or against them) is wrong, and what to do."""


@dataclass(frozen=True)
class Sourced(Generic[T]):
    value: T
    source: str
    """Where it came from, as the startup line says it: a variable, a flag, "the default port"."""


@dataclass(frozen=True)
class Missing:
    hint: str
    """The refusal when nothing else gives the value: what is absent and what would give it."""


@dataclass(frozen=True)
class Told:
    """What one scheduler's variables say about this node's launch."""

    name: str
    node_rank: Sourced[int] | Missing
    nnodes: Sourced[int] | Missing
    host: Sourced[str] | Missing
    """Node 0's host, where the rendezvous and the control store are."""


@dataclass(frozen=True)
class LaunchPlace:
    """The launch values to use. `line` is the startup line saying where each came from ("" without a
    scheduler: the flags, or their defaults, alone)."""

    nnodes: int
    node_rank: int
    endpoint: str
    """HOST:PORT, or "" for one node with no --rdzv-endpoint (a local rendezvous on a free port)."""
    scheduler: str
    line: str


def expand_hostlist(text: str) -> list[str]:
    """A Slurm host list as Slurm writes it (`node[01-04,07]`, `gpu-a[1-2],gpu-b3`, `rack[1-2]-n[1-2]`)
    expanded in its order. Numbers keep the width of the range's first number (`[08-10]` -> 08 09 10,
    `[8-10]` -> 8 9 10); several brackets in one name multiply, the first outermost (hostlist.c).
    Raises SchedulerError saying what cannot be parsed."""
    if not text:
        raise SchedulerError("it names no host")
    if any(ch.isspace() for ch in text):
        raise SchedulerError("it has a blank")
    hosts: list[str] = []
    for token in _top_level_split(text):
        hosts += _expand_token(token, MAX_HOSTS - len(hosts))
        if len(hosts) > MAX_HOSTS:
            raise SchedulerError(f"it expands to more than {MAX_HOSTS} hosts")
    return hosts


def _top_level_split(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    tokens, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise SchedulerError("its brackets are nested or unbalanced")
        if depth == 0 and ch == ",":
            tokens.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise SchedulerError("a '[' is not closed")
    tokens.append(current)
    if not all(tokens):
        raise SchedulerError("it has an empty entry")
    return tokens


def _expand_token(token: str, room: int) -> list[str]:
    """One entry (balanced, unnested brackets), at most `room` hosts."""
    start = token.find("[")
    if start < 0:
        return [token]
    end = token.index("]", start)
    prefix, ids, rest = token[:start], token[start + 1:end], token[end + 1:]
    numbers = _expand_ids(ids, token, room)
    tails = _expand_token(rest, max(1, room // len(numbers))) if rest else [""]
    if len(numbers) * len(tails) > room:
        raise SchedulerError(f"it expands to more than {MAX_HOSTS} hosts")
    return [prefix + n + tail for n in numbers for tail in tails]


_ID_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)


def _expand_ids(ids: str, token: str, room: int) -> list[str]:
    out: list[str] = []
    for part in ids.split(","):
        m = _ID_RANGE.fullmatch(part)
        if not m:
            raise SchedulerError(f"'[{ids}]' in '{token}' is not a list of numbers and ranges like [1-4,7]")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(lo) > int(hi):
            raise SchedulerError(f"the range {part} in '{token}' runs backwards")
        if int(hi) - int(lo) + 1 + len(out) > room:
            raise SchedulerError(f"it expands to more than {MAX_HOSTS} hosts")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def _is_number(raw: str) -> bool:
    return raw.isascii() and raw.isdigit()  # str.isdigit alone takes '²', which int() refuses


def _whole(env: Mapping[str, str], name: str, minimum: int, hint: str) -> Sourced[int] | Missing:
    raw = env.get(name, "").strip()
    if not raw:
        return Missing(hint)
    if not _is_number(raw) or int(raw) < minimum:
        raise SchedulerError(f"{name}={raw!r} is not a whole number >= {minimum}{_USE_NONE}")
    return Sourced(int(raw), name)


def read_port(env: Mapping[str, str]) -> Sourced[int]:
    """The rendezvous port: MEGASCOPE_RDZV_PORT, else MASTER_PORT, else DEFAULT_PORT."""
    for name in PORT_VARS:
        raw = env.get(name, "").strip()
        if raw:
            if not _is_number(raw) or not 1 <= int(raw) <= 65534:
                raise SchedulerError(f"{name}={raw!r} is not a port 1..65534 (the control store takes it + 1)")
            return Sourced(int(raw), name)
    return Sourced(DEFAULT_PORT, "the default port")


def read_slurm(env: Mapping[str, str]) -> Told:
    """Slurm's variables as srun sets them for each task of a step."""
    present = ", ".join(v for v in SLURM_VARS if env.get(v, "").strip()) or "none of " + ", ".join(SLURM_VARS)
    where = (f"Slurm's variables are set ({present}) but not {{}}: run megascope train under srun, one task "
             f"per node (srun --ntasks-per-node=1 megascope train ...){_OR_NONE}")
    nnodes = _whole(env, "SLURM_NNODES", 1, where.format("SLURM_NNODES"))
    host: Sourced[str] | Missing = Missing(where.format("SLURM_JOB_NODELIST"))
    listing = env.get("SLURM_JOB_NODELIST", "").strip()
    if listing:
        try:
            hosts = expand_hostlist(listing)
        except SchedulerError as exc:
            raise SchedulerError(f"SLURM_JOB_NODELIST={listing!r} cannot be parsed: {exc}{_USE_NONE}") from None
        if isinstance(nnodes, Sourced) and len(hosts) != nnodes.value:
            raise SchedulerError(f"SLURM_JOB_NODELIST={listing!r} names {len(hosts)} host(s) but "
                                 f"SLURM_NNODES={nnodes.value}{_USE_NONE}")
        host = Sourced(hosts[0], "SLURM_JOB_NODELIST")
    check_slurm_step(env, nnodes)
    return Told("Slurm", _whole(env, "SLURM_NODEID", 0, where.format("SLURM_NODEID")), nnodes, host)


def check_slurm_step(env: Mapping[str, str], nnodes: Sourced[int] | Missing) -> None:
    """Inside an srun step: one task per node, on every node of the job (the node id and list are the
    job's; a step on part of it, or two drivers on a node, would meet the wrong nodes)."""
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS", "").strip(), env.get("SLURM_STEP_NUM_NODES", "").strip()
    if _is_number(tasks) and _is_number(nodes) and int(tasks) != int(nodes):
        raise SchedulerError(f"srun started {tasks} tasks on {nodes} node(s) (SLURM_STEP_NUM_TASKS, "
                             "SLURM_STEP_NUM_NODES); megascope train runs once per node and starts the node's "
                             f"ranks itself: srun --ntasks-per-node=1 megascope train ...{_OR_NONE}")
    if _is_number(nodes) and isinstance(nnodes, Sourced) and int(nodes) != nnodes.value:
        raise SchedulerError(f"this srun step runs on {nodes} of the job's {nnodes.value} nodes "
                             f"(SLURM_STEP_NUM_NODES, SLURM_NNODES): run srun on all of them{_OR_NONE}")


def read_kubernetes(env: Mapping[str, str], hostname: str) -> Told:
    """A Kubernetes Indexed Job's pod: JOB_COMPLETION_INDEX from Kubernetes; the node count and the
    headless Service's name from the manifest (MEGASCOPE_K8S_NNODES, MEGASCOPE_K8S_SERVICE)."""
    index = _whole(env, K8S_INDEX, 0, f"{K8S_INDEX} is not set (Kubernetes sets it in an Indexed Job's pods)")
    nnodes = _whole(env, K8S_NNODES, 1, f"a Kubernetes indexed job ({K8S_INDEX}) needs the node count: set "
                                        f"{K8S_NNODES} to the Job's completions, or pass --nnodes")
    return Told("Kubernetes", index, nnodes, _kubernetes_host(env, hostname, index))


def _kubernetes_host(env: Mapping[str, str], hostname: str, index: Sourced[int] | Missing) -> Sourced[str] | Missing:
    """Pod 0's stable DNS name `<job>-0.<service>`: an Indexed Job's pod is named `<job>-<index>`, and a
    headless Service that is the pods' subdomain gives each a record `<pod>.<service>`."""
    service = env.get(K8S_SERVICE, "").strip()
    if not service or isinstance(index, Missing):
        return Missing(f"a Kubernetes indexed job needs the headless Service that is the pods' subdomain: set "
                       f"{K8S_SERVICE} to its name, or pass --rdzv-endpoint")
    if not _DNS_LABEL.fullmatch(service):
        raise SchedulerError(f"{K8S_SERVICE}={service!r} is not a Service name (lower-case letters, digits "
                             "and '-', at most 63)")
    suffix = f"-{index.value}"
    if not hostname.endswith(suffix) or len(hostname) == len(suffix):
        return Missing(f"the hostname {hostname!r} is not <job>-{index.value}, as a pod of an Indexed Job with "
                       f"{K8S_INDEX}={index.value} is named, so node 0's name is unknown: pass --rdzv-endpoint")
    return Sourced(f"{hostname[:-len(suffix)]}-0.{service}", f"the pod's hostname with {K8S_SERVICE}")


def pick_scheduler(env: Mapping[str, str], choice: str) -> str | None:
    """"slurm", "kubernetes" or None (the flags alone), from --scheduler and which variables are set."""
    if choice not in SCHEDULERS:
        raise SchedulerError(f"--scheduler {choice!r}: choose one of {', '.join(SCHEDULERS)}")
    if choice != "auto":
        return None if choice == "none" else choice
    slurm = [v for v in SLURM_VARS if env.get(v, "").strip()]
    k8s = env.get(K8S_INDEX, "").strip() != ""
    if slurm and k8s:
        raise SchedulerError(f"both Slurm ({', '.join(slurm)}) and Kubernetes ({K8S_INDEX}) variables are set; "
                             "pass --scheduler slurm or --scheduler kubernetes to say which one launched this "
                             "(or --scheduler none for the launch flags alone)")
    return "slurm" if slurm else "kubernetes" if k8s else None


def settle(flag: str, given: int | None, told: Sourced[int] | Missing) -> Sourced[int]:
    """A value from the flag, the scheduler, or both when they agree."""
    if given is None:
        if isinstance(told, Missing):
            raise SchedulerError(told.hint)
        return told
    if isinstance(told, Missing):
        return Sourced(given, flag)
    if given != told.value:
        raise SchedulerError(f"{flag} {given} disagrees with {told.source}={told.value}; drop the flag (the "
                             f"scheduler's value is used){_OR_NONE}")
    return Sourced(given, f"{flag} (agrees with {told.source})")


def settle_endpoint(given: str | None, host: Sourced[str] | Missing, port: Sourced[int],
                    nnodes: int) -> Sourced[str]:
    """HOST:PORT from --rdzv-endpoint, from node 0's host and the port, or both when they agree."""
    if not given:
        if nnodes == 1:
            return Sourced("", "")
        if isinstance(host, Missing):
            raise SchedulerError(host.hint)
        return Sourced(f"{host.value}:{port.value}", f"{host.source} and {port.source}")
    ghost, colon, gport = given.rpartition(":")
    if not colon or not ghost or not _is_number(gport):
        raise SchedulerError(f"--rdzv-endpoint {given!r} is not HOST:PORT")
    agrees = []
    if isinstance(host, Sourced):
        if ghost != host.value:
            raise SchedulerError(f"--rdzv-endpoint {given} disagrees with {host.source}: node 0 is {host.value} "
                                 f"there; drop the flag (the scheduler's host is used){_OR_NONE}")
        agrees.append(host.source)
    if port.source != "the default port":
        if int(gport) != port.value:
            raise SchedulerError(f"--rdzv-endpoint {given} disagrees with {port.source}={port.value}; drop the "
                                 f"flag or the variable{_OR_NONE}")
        agrees.append(port.source)
    return Sourced(given, "--rdzv-endpoint" + (f" (agrees with {' and '.join(agrees)})" if agrees else ""))


def resolve_launch(env: Mapping[str, str], hostname: str, nnodes: int | None = None, node_rank: int | None = None,
                   endpoint: str | None = None, scheduler: str = "auto") -> LaunchPlace:
    """The launch values from the flags (None/"" when absent) and the scheduler's variables; raises
    SchedulerError with one line on a contradiction or a variable that cannot be read."""
    which = pick_scheduler(env, scheduler)
    if which is None:
        return LaunchPlace(1 if nnodes is None else nnodes, 0 if node_rank is None else node_rank,
                           endpoint or "", "", "")
    told = read_slurm(env) if which == "slurm" else read_kubernetes(env, hostname)
    count = settle("--nnodes", nnodes, told.nnodes)
    rank = settle("--node-rank", node_rank, told.node_rank)
    if not rank.value < count.value:
        raise SchedulerError(f"node rank {rank.value} ({rank.source}) is outside 0..{count.value - 1} "
                             f"({count.value} node(s) from {count.source}){_USE_NONE}")
    place = settle_endpoint(endpoint, told.host, read_port(env), count.value)
    where = f"endpoint {place.value} from {place.source}" if place.value else "a local rendezvous (one node)"
    line = (f"[megascope] launch from {told.name}: node rank {rank.value} from {rank.source}, {count.value} "
            f"node{'s' * (count.value != 1)} from {count.source}, {where}")
    return LaunchPlace(count.value, rank.value, place.value, which, line)
