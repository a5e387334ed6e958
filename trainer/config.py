"""One tree of dataclasses for a training job: defaults < TOML file < command line.

Every field carries a docstring-style comment; `megascope train --help` and docs/config.md are
generated from the same tree, so keep the comments short and true.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import tomllib

from megascope.tracer.config import TraceConfig  # noqa: F401  (the [trace] section; re-exported)
from megascope.tracer.schedule import LEVELS as TRACE_LEVELS

# The string choices of the config, each once: the field's type, the check in validate (CHOICES) and
# the code that acts on them read these.
Recompute = Literal["none", "selective", "full"]
Optimizer = Literal["adamw", "lamb"]
Dtype = Literal["fp32", "bf16"]
Device = Literal["auto", "cpu", "cuda"]
Backend = Literal["auto", "nccl", "gloo"]
SelfCheckWhen = Literal["restart", "always", "off"]
CheckpointFormat = Literal["dcp", "snapshot"]
AttentionBackend = Literal["auto", "cudnn", "flash", "efficient", "math"]  # kernels.attention.SDPA_BACKENDS
RECOMPUTE_MODES: tuple[Recompute, ...] = get_args(Recompute)


@dataclass
class ModelConfig:
    vocab_size: int = 256
    """Vocabulary size; 256 for the byte-level tokenizer. Must be divisible by tp."""
    n_layers: int = 4
    """Transformer blocks. Must be divisible by pp*vpp."""
    hidden: int = 128
    """Hidden size h."""
    n_heads: int = 4
    """Attention heads. Must be divisible by tp."""
    seq_len: int = 64
    """Tokens per sample s. Must be divisible by tp when sequence parallelism is on."""
    ffn_mult: int = 4
    """MLP width as a multiple of hidden."""
    parallel_block: bool = False
    """MegaScale 3.1: attention and MLP side by side from one LayerNorm (y = x + attn(ln(x)) + mlp(ln(x)))."""
    window: int = 0
    """Sliding-window attention width w (each token sees the last w tokens); 0 means full causal attention."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""


@dataclass
class ParallelConfig:
    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row-parallel linears)."""
    pp: int = 1
    """Pipeline-parallel stages."""
    vpp: int = 1
    """Virtual pipeline chunks per stage; >1 selects the interleaved 1F1B schedule."""
    sequence_parallel: bool = True
    """Split LayerNorm/dropout regions along the sequence when tp > 1 (all-gather/reduce-scatter)."""
    zero: bool = True
    """ZeRO-2 distributed optimizer (reduce-scatter grads, all-gather params); False = plain all-reduce."""
    bucket_mb: float = 4.0
    """Gradient bucket size in MiB for the overlapped data-parallel reduction."""
    scatter_gather: bool = True
    """Megatron SC21 4.1: with tp > 1 each rank sends 1/tp of a stage's activation and the receivers all-gather."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (attention core) or full (whole block)."""


@dataclass
class TrainConfig:
    steps: int = 50
    """Optimizer steps to run."""
    global_batch: int = 16
    """Samples per step across all data-parallel ranks."""
    micro_batch: int = 4
    """Samples per micro-batch on one rank. global_batch must be divisible by micro_batch*dp."""
    optimizer: Optimizer = "adamw"
    """adamw or lamb (per-layer trust ratio, MegaScale's choice for 4x batch)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to biases and norms)."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    grad_clip: float = 1.0
    """Clip gradients to this global norm across all shards; 0 disables."""
    seed: int = 1234
    """Seed for weights and data order."""
    dtype: Dtype = "fp32"
    """Compute dtype: fp32 or bf16 (bf16 autocast on GPU)."""
    device: Device = "auto"
    """auto (cuda when present), cpu or cuda."""
    backend: Backend = "auto"
    """Collectives: auto (nccl on cuda, gloo on cpu), nccl or gloo. gloo on cuda lets several ranks share one
    GPU (NCCL refuses that), staging CUDA tensors through the host; it then needs parallel.zero = false."""
    compile: bool = False
    """torch.compile each transformer block (Inductor fuses LayerNorm, GeLU, bias and residual adds);
    the first steps pay the compilation."""
    compile_loss: bool = False
    """torch.compile the final LayerNorm and the cross-entropy (one fused pass over the logits instead of
    several); not the vocab-parallel loss of tp > 1."""
    attention_backend: AttentionBackend = "auto"
    """SDPA backend tried first for full causal attention: auto (torch's order), cudnn, flash, efficient or
    math; others remain the fallback where it does not apply."""


@dataclass
class DataConfig:
    path: str = ""
    """Text file, folder of text files, or uint16 token file (.bin); empty = corpus built from Python's own docs."""
    prefetch: int = 2
    """Batches prepared ahead on a background thread."""


@dataclass
class RobustConfig:
    checkpoint_every: int = -1
    """Save a checkpoint into RUN/checkpoints/ every n steps; -1 = every checkpoint_interval_s of training
    (a step count all ranks agree on after timing the first steps); 0 = never. A restart resumes from the
    latest complete one."""
    checkpoint_interval_s: float = 60.0
    """With checkpoint_every = -1: seconds of training between checkpoints (about what a failure loses).
    Measured (benchmarks/checkpoint_cadence_cost.py): a save costs a dp2 x pp2 rank 1-1.5 ms (tiny) or
    10-36 ms (small) of CPU; even if all 4 ranks' saves came out of training on 2 busy cores, at most 3 or
    72 ms per save: under 0.01% or 0.12% of training time at 60 s. Shorter loses less work on a failure
    but writes more (the gpu preset's state is 3.4 GiB at dp=1, pp=1)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    checkpoint_format: CheckpointFormat = "dcp"
    """dcp: torch.distributed.checkpoint, saved asynchronously (a host copy in the training thread, the
    write in the background), to a path or an fsspec URL, and resumable with another dp (a restart with
    fewer replicas reshards); snapshot: the two-stage host snapshot (one file per shard, local or shared
    filesystem only, same layout to resume). benchmarks/checkpoint_stall.py compares their stalls."""
    checkpoint_dir: str = ""
    """Where checkpoints go: empty = RUN/checkpoints; else a path or an fsspec URL (s3://bucket/ckpt: needs
    the fsspec driver, e.g. s3fs) that every rank can reach (dcp only)."""
    max_restarts: int = 3
    """Automatic restarts of the worker group after a failure (elastic agent); 0 = a failure ends the job."""
    heartbeat_interval_s: float = 1.0
    """Each rank reports host, pid, step, status and its last traced event this often (RUN/heartbeats/)."""
    heartbeat_timeout_s: float = 30.0
    """A rank whose heartbeat is older than this is silent: the driver stops the worker group."""
    stall_timeout_s: float = 120.0
    """No step progress on any rank for this long, once every rank has begun training, is a stall (0 = off);
    keep it above trace.hang_timeout_s so the in-flight records are written before the group is stopped."""
    self_check: SelfCheckWhen = "restart"
    """GEMM and bandwidth self-checks: restart (before each automatic restart), always (also at first start) or off."""
    self_check_threshold: float = 0.5
    """A rank or link below this fraction of its peers' median (and a robust outlier) is flagged."""


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    run_dir: str = ""
    """Run directory; empty = runs/<timestamp>."""
    inject: list[str] = field(default_factory=list)
    """Fault-injection specs (see docs/faults.md)."""

    @property
    def world_size(self) -> int:
        return self.parallel.dp * self.parallel.tp * self.parallel.pp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        cfg = cls()
        apply_overrides(cfg, data, source="dict")
        return cfg


SECTIONS = ("model", "parallel", "train", "data", "trace", "robust")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def apply_overrides(cfg: JobConfig, data: dict[str, Any], source: str) -> None:
    """Merge a nested dict (from TOML or a preset) into cfg, refusing unknown keys."""
    for key, value in data.items():
        if key in SECTIONS:
            section = getattr(cfg, key)
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            for name, v in value.items():
                if not hasattr(section, name):
                    known = ", ".join(f.name for f in dataclasses.fields(section))
                    raise ConfigError(f"{source}: unknown option {key}.{name}; known: {known}")
                setattr(section, name, _coerce(getattr(section, name), v, f"{key}.{name}"))
        elif key in ("run_dir", "inject"):
            setattr(cfg, key, value)
        else:
            raise ConfigError(f"{source}: unknown section or key '{key}'; expected one of {SECTIONS}")


def _coerce(current: Any, value: Any, name: str) -> Any:
    kind = type(current)
    if kind is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "on", "yes"):
                return True
            if value.lower() in ("0", "false", "off", "no"):
                return False
            raise ConfigError(f"{name}: expected on/off, got '{value}'")
        return bool(value)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {kind.__name__}, got '{value}'") from None


def load_toml(cfg: JobConfig, path: str | Path) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass an existing .toml file to --config")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML ({exc})") from None
    apply_overrides(cfg, data, source=str(p))


class Range(NamedTuple):
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        return math.isfinite(value) and \
            (self.low is None or (value > self.low if self.low_open else value >= self.low)) and \
            (self.high is None or (value < self.high if self.high_open else value <= self.high))

    def __str__(self) -> str:
        parts = ([f"{'>' if self.low_open else '>='} {self.low:g}"] if self.low is not None else []) + \
                ([f"{'<' if self.high_open else '<='} {self.high:g}"] if self.high is not None else [])
        return " and ".join(parts)


POSITIVE, AT_LEAST_0, AT_LEAST_1 = Range(0, low_open=True), Range(0), Range(1)
RANGES: dict[str, Range] = {
    "model.vocab_size": AT_LEAST_1, "model.n_layers": AT_LEAST_1, "model.hidden": AT_LEAST_1,
    "model.n_heads": AT_LEAST_1, "model.seq_len": AT_LEAST_1, "model.ffn_mult": AT_LEAST_1,
    "model.norm_eps": POSITIVE, "parallel.bucket_mb": POSITIVE,
    "train.steps": AT_LEAST_1, "train.global_batch": AT_LEAST_1, "train.micro_batch": AT_LEAST_1,
    "train.lr": POSITIVE, "train.min_lr": AT_LEAST_0, "train.warmup_steps": AT_LEAST_0,
    "train.weight_decay": AT_LEAST_0, "train.beta1": Range(0, 1, high_open=True),
    "train.beta2": Range(0, 1, high_open=True), "train.grad_clip": AT_LEAST_0,
    "train.seed": AT_LEAST_0,  # numpy's default_rng takes no negative seed
    "data.prefetch": AT_LEAST_0,
    "trace.every": AT_LEAST_1, "trace.flush_interval_s": POSITIVE, "trace.job_flushes_per_s": POSITIVE,
    "trace.flush_events": AT_LEAST_1,
    "trace.max_buffered_events": AT_LEAST_1, "trace.hang_timeout_s": POSITIVE,
    "trace.clock_sync_every": AT_LEAST_0, "trace.nvml_interval_s": POSITIVE, "trace.summary_every": AT_LEAST_0,
    "trace.cupti_every": AT_LEAST_1, "trace.cupti_buffer_mb": AT_LEAST_1,
    "robust.checkpoint_every": Range(-1), "robust.checkpoint_interval_s": POSITIVE,
    "robust.keep_last": AT_LEAST_1, "robust.max_restarts": AT_LEAST_0,
    "robust.heartbeat_interval_s": POSITIVE, "robust.heartbeat_timeout_s": AT_LEAST_0,
    "robust.stall_timeout_s": AT_LEAST_0, "robust.self_check_threshold": Range(0, 1, low_open=True),
}
"""Numeric fields and the values they accept: anything else is refused before launch (a negative
learning rate, say, would train and diverge without a word)."""


def check_ranges(cfg: JobConfig) -> None:
    """Raise ConfigError naming the first field outside its range in RANGES (NaN and inf included)."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not allowed.holds(value):
            raise ConfigError(f"{key} must be {allowed}, got {value!r}; "
                              f"change the flag, the --config file or --set {key}=VALUE")


CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    # field: (how the message names it, the values it accepts)
    "train.optimizer": ("optimizer", get_args(Optimizer)),
    "train.dtype": ("dtype", get_args(Dtype)),
    "train.device": ("device", get_args(Device)),
    "train.backend": ("backend", get_args(Backend)),
    "train.attention_backend": ("attention backend", get_args(AttentionBackend)),
    "parallel.recompute": ("recompute", RECOMPUTE_MODES),
    "trace.level": ("trace level", TRACE_LEVELS),
    "robust.self_check": ("robust.self_check", get_args(SelfCheckWhen)),
    "robust.checkpoint_format": ("robust.checkpoint_format", get_args(CheckpointFormat)),
}
"""String fields and the values they accept (the Literal types above; the trace level is the tracer's)."""


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + f" or {values[-1]}"


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raise ConfigError naming what to change if a value is out of range or the layout or shapes
    cannot work together."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("dp", "tp", "pp", "vpp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(p, name)}")
    check_ranges(cfg)
    if world_size is not None and world_size != cfg.world_size:
        raise ConfigError(
            f"dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {cfg.world_size} but the job has {world_size} processes; "
            "change --dp/--tp/--pp or the number of processes per node/nodes")
    if m.n_heads % p.tp:
        raise ConfigError(f"n_heads={m.n_heads} is not divisible by tp={p.tp}; pick a tp that divides it")
    if m.hidden % m.n_heads:
        raise ConfigError(f"hidden={m.hidden} is not divisible by n_heads={m.n_heads}")
    if m.vocab_size % p.tp:
        raise ConfigError(f"vocab_size={m.vocab_size} is not divisible by tp={p.tp}")
    if (m.hidden * m.ffn_mult) % p.tp:
        raise ConfigError(f"MLP width {m.hidden * m.ffn_mult} is not divisible by tp={p.tp}")
    check_layout(cfg)
    if m.window < 0:
        raise ConfigError(f"window must be >= 0 (0 = full attention), got {m.window}")
    for key, (what, allowed) in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{what} '{value}' unknown; use {_one_of(allowed)}")
    if t.steps < 1:
        raise ConfigError("--steps must be >= 1")
    if t.device != "auto":
        check_backend(cfg, t.device)
    r = cfg.robust
    if r.checkpoint_format == "snapshot" and "://" in r.checkpoint_dir:
        raise ConfigError(f"robust.checkpoint_dir {r.checkpoint_dir} is a URL: only robust.checkpoint_format=dcp "
                          "writes to one; set --set robust.checkpoint_format=dcp or give a local path")
    if 0 < r.heartbeat_timeout_s <= 2 * r.heartbeat_interval_s:
        raise ConfigError(f"robust.heartbeat_timeout_s ({r.heartbeat_timeout_s}) must exceed twice "
                          f"robust.heartbeat_interval_s ({r.heartbeat_interval_s}), or be 0 (off)")


def backend_for(cfg: JobConfig, device_type: str) -> str:
    """The collectives backend the ranks use on `device_type` ('cuda' or 'cpu')."""
    if cfg.train.backend != "auto":
        return cfg.train.backend
    return "nccl" if device_type == "cuda" else "gloo"


def check_backend(cfg: JobConfig, device_type: str) -> None:
    """Raise ConfigError when the backend cannot run this job on `device_type` (validate checks it before
    launch when --device is explicit; each rank again once `auto` has resolved)."""
    p, backend = cfg.parallel, backend_for(cfg, device_type)
    if backend == "nccl" and device_type == "cpu":
        raise ConfigError("train.backend=nccl needs --device cuda (NCCL has no CPU path); use gloo or auto")
    if backend == "gloo" and device_type == "cuda" and (p.zero or p.tp > 1 or p.pp > 1):
        # gloo moves CUDA tensors for all-reduce and broadcast only: no reduce-scatter, all-gather into
        # one tensor or send/recv, which ZeRO, tensor and pipeline parallelism need.
        raise ConfigError("train.backend=gloo on a GPU runs data parallelism only: set --set parallel.zero=false, "
                          "--tp 1 and --pp 1 (or use --device cpu, or backend nccl)")


def check_layout(cfg: JobConfig) -> None:
    """Raise ConfigError when the layers, micro-batches and sequence do not split over the parallel
    layout (validate before launch; trainer/parallel/parallelize.py again on each rank, where a config built
    in code may not have been validated)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.n_layers % (p.pp * p.vpp):
        raise ConfigError(
            f"n_layers={m.n_layers} is not divisible by pp*vpp={p.pp * p.vpp}; "
            "change --pp/--vpp or the number of layers")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError("--vpp > 1 needs --pp > 1 (virtual chunks interleave pipeline stages)")
    if p.tp > 1 and p.sequence_parallel and m.seq_len % p.tp:
        raise ConfigError(f"seq_len={m.seq_len} is not divisible by tp={p.tp} (needed by sequence parallelism)")
    if t.global_batch % (t.micro_batch * p.dp):
        raise ConfigError(
            f"global_batch={t.global_batch} is not divisible by micro_batch*dp={t.micro_batch}*{p.dp}; "
            "change --global-batch, --micro-batch or --dp")
    n_micro = micro_batches(cfg)
    if p.vpp > 1 and n_micro % p.pp:
        raise ConfigError(
            f"the interleaved schedule needs micro-batches ({n_micro}) divisible by pp={p.pp}; "
            "change --global-batch or --micro-batch")


def micro_batches(cfg: JobConfig) -> int:
    """Micro-batches per step on one data-parallel rank: m = global_batch / (micro_batch * dp)."""
    return cfg.train.global_batch // (cfg.train.micro_batch * cfg.parallel.dp)
