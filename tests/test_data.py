"""Tokenizer, corpus loading, deterministic dp-split sampling, prefetching and the tp broadcast."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megascope.samples.distributed import run_distributed
from megascope.trainer.config import JobConfig
from megascope.trainer.data import (
    DEFAULT_CORPUS_BYTES,
    BatchLoader,
    BatchSampler,
    ByteTokenizer,
    DataError,
    build_loader,
    default_corpus,
    load_tokens,
)
from megascope.trainer.parallel.parallel_dims import ParallelDims

SEQ = 16


def sampler(n_tokens: int, dp: int = 1, dp_rank: int = 0, seed: int = 7, micro: int = 2) -> BatchSampler:
    return BatchSampler(n_tokens, SEQ, global_batch=8, micro_batch=micro, dp_size=dp, dp_rank=dp_rank, seed=seed)


def corpus() -> np.ndarray:
    return np.arange(5000, dtype=np.uint16) % 251


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids.max() < tok.vocab_size and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids.astype(np.int64))) == text


def test_default_corpus_is_deterministic_python_source():
    a, b = default_corpus(), default_corpus()
    assert a.size == DEFAULT_CORPUS_BYTES
    assert np.array_equal(a, b)
    text = ByteTokenizer().decode(a[:200_000])
    assert "def " in text and '"""' in text
    assert np.array_equal(load_tokens(""), a)


def test_text_file_folder_and_bin_inputs(tmp_path: Path):
    (tmp_path / "a.txt").write_text("hello ")
    sub = tmp_path / "docs"
    sub.mkdir()
    (sub / "b.txt").write_text("alpha")
    (sub / "c.md").write_text("beta")
    assert ByteTokenizer().decode(load_tokens(str(tmp_path / "a.txt"))) == "hello "
    assert ByteTokenizer().decode(load_tokens(str(sub))) == "alpha\nbeta"
    ids = np.array([1, 300, 2, 65535], dtype=np.uint16)
    ids.tofile(tmp_path / "tok.bin")
    got = load_tokens(str(tmp_path / "tok.bin"), vocab_size=65536)
    assert got.dtype == np.uint16 and got.tolist() == [1, 300, 2, 65535]


def test_bad_inputs_say_what_to_do(tmp_path: Path):
    with pytest.raises(DataError, match="no such file or folder.*built-in corpus"):
        load_tokens(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no tokens"):
        load_tokens(str(tmp_path / "empty.txt"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="uint16"):
        load_tokens(str(tmp_path / "odd.bin"))
    np.array([5, 999], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match="vocab_size"):
        load_tokens(str(tmp_path / "big.bin"), vocab_size=256)
    with pytest.raises(DataError, match="seq_len"):
        sampler(n_tokens=SEQ)


def test_sampling_is_a_function_of_seed_and_step():
    tokens = corpus()
    s = sampler(tokens.size)
    assert s.batch(tokens, 3).shape == (4, 2, SEQ + 1)
    assert np.array_equal(s.batch(tokens, 3), s.batch(tokens, 3))
    assert not np.array_equal(s.batch(tokens, 3), s.batch(tokens, 4))
    assert not np.array_equal(s.batch(tokens, 3), sampler(tokens.size, seed=8).batch(tokens, 3))
    window = s.batch(tokens, 0)[0, 0]
    assert np.array_equal(np.diff(window) % 251, np.ones(SEQ, dtype=np.int64))  # a contiguous window


def test_dp_ranks_partition_the_single_process_batch_in_order():
    tokens = corpus()
    single = sampler(tokens.size, micro=2).batch(tokens, 5).reshape(-1, SEQ + 1)
    for dp in (2, 4):
        parts = [sampler(tokens.size, dp, r, micro=2).batch(tokens, 5) for r in range(dp)]
        assert parts[0].shape == (4 // dp, 2, SEQ + 1)
        assert np.array_equal(np.concatenate([p.reshape(-1, SEQ + 1) for p in parts]), single)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_loader_yields_the_sampled_steps_and_resumes(prefetch: int):
    tokens = corpus()
    s = sampler(tokens.size)
    loader = BatchLoader(s, tokens, torch.device("cpu"), prefetch=prefetch, start_step=2)
    try:
        for step in (2, 3, 4):
            batch, waited = loader.next()
            assert batch.dtype == torch.int64 and waited >= 0.0
            assert torch.equal(batch, torch.from_numpy(s.batch(tokens, step)))
    finally:
        loader.close()
    assert loader.reads_data


def test_loader_reports_a_failing_data_thread():
    tokens = corpus()[:100]
    lying = sampler(n_tokens=10_000)  # offsets past the real end give short windows
    loader = BatchLoader(lying, tokens, torch.device("cpu"), prefetch=2)
    try:
        with pytest.raises(DataError, match="data thread failed"):
            for _ in range(20):
                loader.next()
    finally:
        loader.close()


def _loader_on_rank(rank: int, world: int, path: str) -> dict:
    dims = ParallelDims(dp=2, tp=2, pp=1)
    dims.build_groups()
    cfg = JobConfig()
    cfg.data.path = path
    cfg.model.seq_len = SEQ
    cfg.train.global_batch, cfg.train.micro_batch = 8, 2
    loader = build_loader(cfg, dims, rank, torch.device("cpu"))
    try:
        batches = [loader.next()[0].tolist() for _ in range(2)]
    finally:
        loader.close()
    return {"reads": loader.reads_data, "batches": batches, "dp": dims.coords(rank).dp}


def test_tp_rank0_reads_and_broadcasts_dp_ranks_split(tmp_path: Path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 20)
    out = run_distributed(_loader_on_rank, 4, str(path))
    assert [o["reads"] for o in out] == [True, False, True, False]
    assert out[0]["batches"] == out[1]["batches"] and out[2]["batches"] == out[3]["batches"]
    assert out[0]["batches"] != out[2]["batches"]
    tokens = load_tokens(str(path))
    single = BatchSampler(tokens.size, SEQ, 8, 2, 1, 0, JobConfig().train.seed)
    for step in range(2):
        merged = np.concatenate([np.array(out[r]["batches"][step]).reshape(-1, SEQ + 1) for r in (0, 2)])
        assert np.array_equal(merged, single.batch(tokens, step).reshape(-1, SEQ + 1))
