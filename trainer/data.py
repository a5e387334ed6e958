"""Training data: byte tokenizer, corpus loading, deterministic sampling and a prefetching loader.

Tokens are bytes (ids 0..255), so any text trains without a vocabulary file. The default corpus is
built at run time from the Python standard library's own sources (code and docstrings, a few MB,
deterministic order; nothing is downloaded). `--data PATH` takes a text file, a folder of text files
or a uint16 token file (`.bin`).

Sampling is a pure function of (seed, step): step s draws `global_batch` window offsets from
`default_rng([seed, s])`; data-parallel rank d takes the d-th contiguous slice of them, as
[micro_batches, micro_batch, seq_len + 1]. So a resumed run sees the same data, and the dp ranks'
batches, concatenated in rank order, are exactly the batch a dp=1 run gets for the same step.

Only tensor-parallel rank 0 reads and samples (on a background thread, `prefetch` batches ahead);
it broadcasts each batch to the rest of its tp group (MegaScale 3.4).
"""

from __future__ import annotations

import os
import queue
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from megascope.tracer import comm
from megascope.trainer.config import JobConfig
from megascope.trainer.parallel.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DEFAULT_CORPUS_BYTES = 4 << 20
"""Size of the built-in corpus: the first 4 MiB of stdlib sources in sorted path order."""


class DataError(ValueError):
    """Unusable training data; the message says what to pass instead."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int] | np.ndarray | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """Python's standard library sources (code and docstrings) as byte tokens: files in sorted
    pre-order (a folder's own files, then its sub-folders), up to max_bytes."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for folder, subdirs, files in os.walk(stdlib):
        subdirs[:] = sorted(d for d in subdirs if d not in _NOT_STDLIB)  # prunes and orders the walk
        for name in sorted(f for f in files if f.endswith(".py")):
            data = Path(folder, name).read_bytes()[:max_bytes - total]
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if total == 0:
        raise DataError(f"no Python sources found under {stdlib}; pass --data PATH to a text file")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def check_data_path(path: str) -> None:
    """Fail early (before launching ranks) on a path that cannot be training data."""
    if path and not Path(path).exists():
        raise DataError(f"--data {path}: no such file or folder; pass a text file, a folder of text "
                        "files or a uint16 token file (.bin), or leave it empty for the built-in corpus")


def load_tokens(path: str, vocab_size: int = ByteTokenizer.vocab_size) -> np.ndarray:
    """Token ids of the corpus at `path` ("" = the built-in one): uint8 for text, uint16 for .bin."""
    check_data_path(path)
    if not path:
        return default_corpus()
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        if not files:
            raise DataError(f"--data {path}: the folder has no files; put text files in it")
        tokens = np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8)
    elif p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise DataError(f"--data {path}: a .bin token file must hold uint16 ids (even byte size), "
                            f"it has {p.stat().st_size} bytes")
        tokens = np.memmap(p, dtype=np.uint16, mode="r") if p.stat().st_size else np.zeros(0, np.uint16)
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise DataError(f"--data {path}: token id {int(tokens.max())} >= vocab_size {vocab_size}; "
                            "raise model.vocab_size or re-tokenize")
    else:
        tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
    if tokens.size == 0:
        raise DataError(f"--data {path}: no tokens (empty input)")
    return tokens


@dataclass(frozen=True)
class BatchSampler:
    """Which windows of the corpus each dp rank trains on at each step (no data, only offsets)."""

    n_tokens: int
    seq_len: int
    global_batch: int
    micro_batch: int
    dp_size: int
    dp_rank: int
    seed: int

    def __post_init__(self) -> None:
        if self.n_tokens < self.seq_len + 1:
            raise DataError(f"the corpus has {self.n_tokens} tokens but one sample needs seq_len+1 = "
                            f"{self.seq_len + 1}; use more data or a shorter model.seq_len")
        if self.global_batch % (self.micro_batch * self.dp_size):
            raise DataError(f"global_batch={self.global_batch} is not divisible by micro_batch*dp="
                            f"{self.micro_batch}*{self.dp_size}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """[micro_batches, micro_batch, seq_len + 1] of one rank's batch."""
        per_rank = self.global_batch // self.dp_size
        return (per_rank // self.micro_batch, self.micro_batch, self.seq_len + 1)

    def global_offsets(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.n_tokens - self.seq_len, size=self.global_batch)

    def batch(self, tokens: np.ndarray, step: int) -> np.ndarray:
        """This rank's int64 batch for `step`, shaped `self.shape`."""
        per_rank = self.global_batch // self.dp_size
        offsets = self.global_offsets(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        windows = np.stack([tokens[o:o + self.seq_len + 1] for o in offsets]).astype(np.int64)
        return windows.reshape(self.shape)


class BatchLoader:
    """`next() -> (batch, wait_seconds)`: the step's batch on `device` and how long the caller waited
    for it (queue + copy + tp broadcast: the tracer's data_wait). Steps run from `start_step` on."""

    def __init__(self, sampler: BatchSampler, tokens: np.ndarray | None, device: torch.device,
                 prefetch: int = 2, start_step: int = 0, tp_group: ProcessGroup | None = None,
                 tp_src: int = 0) -> None:
        self.sampler = sampler
        self.tokens = tokens
        self.reads_data = tokens is not None
        """True on the rank that reads (tp rank 0); the others receive by broadcast."""
        self.device = device
        self.tp_group = tp_group
        self.tp_src = tp_src
        self.step = start_step
        self._pin = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.reads_data and prefetch > 0:
            self._thread = threading.Thread(target=self._produce, name="megascope-data", daemon=True)
            self._thread.start()

    def _make(self, step: int) -> torch.Tensor:
        assert self.tokens is not None  # called only when reads_data
        batch = torch.from_numpy(self.sampler.batch(self.tokens, step))
        return batch.pin_memory() if self._pin else batch

    def _produce(self) -> None:
        step = self.step
        while not self._stop.is_set():
            try:
                item: object = self._make(step)
            except BaseException as exc:  # hand it to the training loop instead of dying silently
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            step += 1

    def next(self) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        if not self.reads_data:
            batch = torch.empty(self.sampler.shape, dtype=torch.int64, device=self.device)
        else:
            item = self._queue.get() if self._thread is not None else self._make(self.step)
            if isinstance(item, BaseException):
                raise DataError(f"the data thread failed at step {self.step}: {item!r}") from item
            batch = item.to(self.device, non_blocking=True)
        if self.tp_group is not None:
            comm.broadcast(batch, self.tp_src, self.tp_group, "tp", name="data_broadcast")
        self.step += 1
        return batch, time.perf_counter() - start

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def build_loader(cfg: JobConfig, dims: ParallelDims, rank: int, device: torch.device,
                 start_step: int = 0) -> BatchLoader:
    """The loader of global rank `rank`: tp rank 0 reads and broadcasts, the others receive."""
    check_data_path(cfg.data.path)
    c = dims.coords(rank)
    tokens = load_tokens(cfg.data.path, cfg.model.vocab_size) if c.tp == 0 else None
    # non-reading ranks never index the corpus; n_tokens only has to pass the sampler's size check
    n_tokens = tokens.size if tokens is not None else cfg.model.seq_len + 1
    sampler = BatchSampler(n_tokens, cfg.model.seq_len, cfg.train.global_batch, cfg.train.micro_batch,
                           dims.dp, c.dp, cfg.train.seed)
    tp_group = dims.groups["tp"] if dims.tp > 1 else None
    return BatchLoader(sampler, tokens, device, cfg.data.prefetch, start_step, tp_group,
                       tp_src=dims.rank_of(c.pp, c.dp, 0))
