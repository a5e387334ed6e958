"""Fault injection (`megascope train --inject SPEC`): real effects, so the diagnosis has something to find.

Specs are parsed and validated before launch; each rank builds a `Faults` holding only the faults
that touch it, and the trainer calls its hooks at a few places:

    with faults.compute():          around each forward/backward (straggler)
    faults.in_data_wait()           inside the step's data_wait span, before the batch (slow_data)
    faults.before_step_work()       after the batch, before the forward: the job's own host work (gc)
    faults.before_dp_collective()   before each data-parallel collective is issued (late launch)
    faults.before_p2p(peers)        before pipeline sends/receives (link flap)
    faults.at_step_start(step)      hang / crash
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # torch is imported only where a GPU rank needs it: `megascope simulate` parses specs here too
    import torch


class FaultSpecError(ValueError):
    """A malformed or inapplicable fault spec (`megascope train --inject`, `megascope simulate --inject`);
    the message shows the accepted syntax."""


@dataclass(frozen=True)
class FaultKind:
    """The fields one kind of fault takes on one side (the trainer or the simulator)."""

    required: tuple[str, ...]
    """Each entry must be given; "rank|ranks" means either one."""
    optional: tuple[str, ...]
    syntax: str

    def fields(self) -> set[str]:
        return {name for entry in self.required for name in entry.split("|")} | set(self.optional)


TRAIN_KINDS: dict[str, FaultKind] = {
    "straggler": FaultKind(("rank", "slowdown"), ("from", "to"), "straggler:rank=R,slowdown=X[,from=S][,to=S]"),
    "late_launch": FaultKind(("rank", "ms"), ("every",), "late_launch:rank=R,ms=M[,every=K]"),
    "flap": FaultKind(("ranks", "down_ms", "period_steps"), (), "flap:ranks=A-B,down_ms=D,period_steps=P"),
    "hang": FaultKind(("rank", "at"), (), "hang:rank=R,at=S"),
    "crash": FaultKind(("rank", "at"), (), "crash:rank=R,at=S"),
    "slow_data": FaultKind(("rank", "ms"), ("from", "to"), "slow_data:rank=R,ms=M[,from=S][,to=S]"),
    "gc": FaultKind(("rank", "objects"), ("from", "to"), "gc:rank=R,objects=N[,from=S][,to=S]"),
}
"""What `megascope train --inject` can do to a real job (the hooks of `Faults` below)."""
SIMULATE_KINDS: dict[str, FaultKind] = {
    "straggler": FaultKind(("rank|ranks", "slowdown"), ("from", "to"),
                           "straggler:rank=R|ranks=A-B,slowdown=X[,from=S][,to=S]"),
    "late_launch": FaultKind(("rank", "ms"), ("every", "from", "to"),
                             "late_launch:rank=R,ms=M[,every=K][,from=S][,to=S]"),
    "flap": FaultKind(("ranks", "down_ms", "period_steps"), ("len", "from"),
                      "flap:ranks=A-B,down_ms=D,period_steps=P[,len=L][,from=S]"),
    "hang": FaultKind(("rank", "at"), (), "hang:rank=R,at=S"),
    "imbalance": FaultKind(("stage", "slowdown"), ("from", "to"), "imbalance:stage=P,slowdown=X[,from=S][,to=S]"),
    "slow_link": FaultKind(("ranks", "factor"), ("from", "to"), "slow_link:ranks=A-B,factor=X[,from=S][,to=S]"),
}
"""What `megascope simulate --inject` can put in a simulated run (samples/faults_sim.py builds them)."""
SIDES = {"megascope train": TRAIN_KINDS, "megascope simulate": SIMULATE_KINDS}


def usage(kinds: dict[str, FaultKind]) -> str:
    return " | ".join(k.syntax for k in kinds.values())


USAGE = usage(TRAIN_KINDS)


def parse_fields(text: str, kinds: dict[str, FaultKind]) -> tuple[str, dict[str, str]]:
    """The one fault grammar, `kind:key=value,...`: (kind, {key: value}) with the kind known to `kinds`
    (TRAIN_KINDS or SIMULATE_KINDS) and its fields complete; values are left to the caller to read."""
    kind, _, rest = text.partition(":")
    if kind not in kinds:
        elsewhere = [side for side, known in SIDES.items() if kind in known and known is not kinds]
        only = f" ('{kind}' is a fault of {elsewhere[0]} only)" if elsewhere else ""
        raise FaultSpecError(f"--inject '{text}': unknown fault '{kind}'{only}; the kinds are "
                             f"{', '.join(kinds)}: {usage(kinds)}")
    spec = kinds[kind]
    fields: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in spec.fields():
            raise FaultSpecError(f"--inject '{text}': bad field '{item}'; syntax: {spec.syntax}")
        fields[key] = value.strip()
    missing = [entry.replace("|", " or ") for entry in spec.required if not set(entry.split("|")) & fields.keys()]
    if missing:
        raise FaultSpecError(f"--inject '{text}': missing {', '.join(missing)}; syntax: {spec.syntax}")
    return kind, fields


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    params: dict[str, float] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    text: str = ""

    def active(self, step: int) -> bool:
        return self.params.get("from", 0) <= step <= self.params.get("to", float("inf"))


def parse_spec(text: str, world_size: int) -> FaultSpec:
    """A `megascope train --inject` spec, checked against the job's world size."""
    kind, fields = parse_fields(text, TRAIN_KINDS)
    params: dict[str, float] = {}
    ranks: tuple[int, ...] = ()
    for key, value in fields.items():
        try:
            if key == "ranks":
                a, _, b = value.partition("-")
                ranks = (int(a), int(b))
            else:
                params[key] = float(value)
        except ValueError:
            raise FaultSpecError(f"--inject '{text}': '{value}' is not a number in '{key}={value}'") from None
    if "rank" in params:
        ranks = (int(params.pop("rank")),)
    for r in ranks:
        if not 0 <= r < world_size:
            raise FaultSpecError(f"--inject '{text}': rank {r} is outside the world (0..{world_size - 1})")
    if kind == "straggler" and params["slowdown"] < 1:
        raise FaultSpecError(f"--inject '{text}': slowdown must be >= 1 (2 = twice as slow)")
    if kind in ("slow_data", "gc") and params.get("ms", params.get("objects", 0)) <= 0:
        raise FaultSpecError(f"--inject '{text}': {'ms' if kind == 'slow_data' else 'objects'} must be > 0")
    if kind == "flap" and (len(set(ranks)) != 2 or params["period_steps"] < 2):
        raise FaultSpecError(f"--inject '{text}': a flap needs two different ranks A-B and period_steps >= 2")
    return FaultSpec(kind=kind, params=params, ranks=ranks, text=text)


def parse_specs(texts: list[str], world_size: int) -> list[FaultSpec]:
    return [parse_spec(t, world_size) for t in texts]


class Faults:
    """The faults that touch one rank, with the hooks the trainer calls. Empty = every hook is a no-op."""

    def __init__(self, specs: list[FaultSpec], rank: int, device: torch.device | None = None) -> None:
        self.rank = rank
        self.specs = [s for s in specs if rank in s.ranks]
        self.step = 0
        self._gpu_delay = GpuDelay(device) if device is not None and device.type == "cuda" else None
        self._heap: list[tuple[int, str]] = []
        """The gc fault's live objects: what a full collection walks every step."""

    def at_step_start(self, step: int) -> None:
        self.step = step
        for s in self.specs:
            if s.kind == "crash" and step == s.params["at"]:
                print(f"[megascope] injected crash on rank {self.rank} at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if s.kind == "hang" and step == s.params["at"]:
                print(f"[megascope] injected hang on rank {self.rank} at step {step}", flush=True)
                while True:  # the rank stops issuing work and never returns
                    time.sleep(3600)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Stretch the enclosed compute by the straggler's slowdown, in proportion to its own time.
        On a CPU rank the delay is a sleep; on a GPU rank it is extra matrix products on the rank's
        stream (GpuDelay), so the GPU itself is slower, as a throttled or faulty GPU is, and the
        CUDA-event spans time it. The GPU rank's region is timed between two synchronizations
        (note: CPU-GPU sync points, taken only on the injected rank): without the first, the
        previous delay still queued would count as compute and the slowdown would compound."""
        factor = max((s.params["slowdown"] for s in self.specs
                      if s.kind == "straggler" and s.active(self.step)), default=1.0)
        if factor == 1.0:
            yield
            return
        if self._gpu_delay is not None:
            self._gpu_delay.synchronize()
        start = time.perf_counter()
        yield
        if self._gpu_delay is not None:
            self._gpu_delay.synchronize()
            self._gpu_delay.run((factor - 1.0) * (time.perf_counter() - start))
        else:
            time.sleep((factor - 1.0) * (time.perf_counter() - start))

    def in_data_wait(self) -> None:
        """A slow data loader (slow_data): the batch takes `ms` longer to arrive, inside the data_wait span
        as a loader reading a slow disk or decoding on the training thread would."""
        for s in self.specs:
            if s.kind == "slow_data" and s.active(self.step):
                time.sleep(s.params["ms"] / 1000.0)

    def before_step_work(self) -> None:
        """GC pressure (gc): the rank holds `objects` live tuples and runs a full gc.collect() every step,
        as a job with a large Python heap and a per-step collection (or an allocation-heavy loop whose
        automatic collections reach the oldest generation) does; the tracer times it via gc.callbacks."""
        for s in self.specs:
            if s.kind == "gc" and s.active(self.step):
                if not self._heap:
                    self._heap = [(i, str(i)) for i in range(int(s.params["objects"]))]
                gc.collect()

    def before_dp_collective(self) -> None:
        for s in self.specs:
            if s.kind == "late_launch" and self.step % int(s.params.get("every", 1)) == 0:
                time.sleep(s.params["ms"] / 1000.0)

    def before_p2p(self, peers: list[int]) -> None:
        """Stall transfers on a flapping link during its 'down' half-periods."""
        for s in self.specs:
            if s.kind != "flap" or not (set(s.ranks) - {self.rank}) & set(peers):
                continue
            period = int(s.params["period_steps"])
            if (self.step // max(1, period // 2)) % 2 == 1:
                time.sleep(s.params["down_ms"] / 1000.0)


class GpuDelay:
    """Keeps a GPU busy for about `seconds` with bf16 matrix products queued on the current stream
    (the host does not wait for them). The time per product is measured once, with CUDA events, on
    first use; on a GPU shared with other processes it is measured under their load."""

    SIZE = 2048
    """Products of SIZE x SIZE: ~17 GFLOP, tens of microseconds on a current GPU, so the delay is
    finely divided yet each launch is well above launch overhead."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._a: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._seconds_per_product = 0.0

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def run(self, seconds: float) -> None:
        import torch

        if self._a is None:
            self._calibrate()
        assert self._a is not None and self._out is not None
        for _ in range(round(seconds / self._seconds_per_product)):
            torch.mm(self._a, self._a, out=self._out)

    def _calibrate(self, products: int = 20) -> None:
        import torch

        self._a = torch.randn(self.SIZE, self.SIZE, device=self.device, dtype=torch.bfloat16)
        self._out = torch.empty_like(self._a)
        torch.mm(self._a, self._a, out=self._out)  # warm-up: cuBLAS handle and kernel choice
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(products):
            torch.mm(self._a, self._a, out=self._out)
        end.record()
        end.synchronize()  # note: CPU-GPU sync point, once, on the injected rank
        self._seconds_per_product = start.elapsed_time(end) / 1e3 / products
