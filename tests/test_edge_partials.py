"""analyzer/data/edge_partials.py: the collective partials of a batch's edge_collectives rows computed in
numpy give edge_collectives.sql's rows (collective_partials_of_members): the same rows, columns and types,
every value equal; the issue sums exactly when the batch is one chunk (rows summed in the order DuckDB's
one thread sums them), to the last bits otherwise (chunks' sums added, as DuckDB's threads add theirs).
On a job written by samples/edge_gen.py and on member rows written to segments here with the cases the
key and the tie rule must get right; the cases it does not take (a damaged or mistyped segment, a rank
outside the layout) return None, which sends the batch to the macro."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascope.analyzer import Run
from megascope.analyzer.data import event_pass as ep
from megascope.analyzer.data.edge_partials import numpy_pays, partials_of_files
from megascope.analyzer.data.store import load_sql
from megascope.samples.edge_gen import EdgeGenConfig, generate
from megascope.tracer.edge_summary import edge_sql
from megascope.tracer.schema import EDGE_COLLECTIVES

KEYS = ["group", "instance", "seq", "op_name"]
BASE = -3_600_000_000_000


def _macro(files: list[str], base: int, dp: int, tp: int, cp: int = 1, renumber: list[int] | None = None
           ) -> pa.Table:
    """collective_partials_of_members over `files`, on one DuckDB thread (a fixed summation order)."""
    con = duckdb.connect()
    con.execute("SET threads=1")
    con.execute(edge_sql("group_instance"))
    con.execute(load_sql("edge_collectives"))
    listing = "[" + ", ".join(f"'{f}'" for f in files) + "]"
    con.execute(f"CREATE VIEW src AS SELECT * FROM read_parquet({listing}, hive_partitioning=false)")
    return con.sql("FROM collective_partials_of_members('src', $base, $dp, $tp, $cp, $renumber)",
                   params={"base": base, "dp": dp, "tp": tp, "cp": cp, "renumber": renumber}).to_arrow_table()


def _assert_same(numpy_rows: pa.Table | None, macro: pa.Table, exact_sums: bool) -> None:
    assert numpy_rows is not None
    assert numpy_rows.schema == macro.schema
    got, want = (t.to_pandas().sort_values(KEYS).reset_index(drop=True) for t in (numpy_rows, macro))
    sums = ["issue_sum_ms"] if not exact_sums else []
    pd.testing.assert_frame_equal(got.drop(columns=sums), want.drop(columns=sums), check_exact=True)
    if sums:
        np.testing.assert_allclose(got.issue_sum_ms, want.issue_sum_ms, rtol=4e-16 * 8, atol=0)


# ---- a generated job --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    cfg = EdgeGenConfig(dp=4, tp=8, pp=8, steps=50, faults=[])
    return generate(tmp_path_factory.mktemp("edge-partials") / "run", cfg, batch_ranks=128)


def _files(run: Path, ranks: range) -> list[str]:
    return [str(f) for r in ranks for f in sorted((run / "edge_collectives" / f"rank={r:05d}").glob("*.parquet"))]


@pytest.mark.parametrize("ranks", [range(0, 100), range(100, 256), range(0, 256)])
def test_generated_batches_equal_the_macro(job, ranks):
    """Batches that split tensor-parallel groups (rank 100) and data-parallel ones, in one chunk (the sums
    bit-equal) and in chunks of ~5 ranks (merged across chunks)."""
    files = _files(job, ranks)
    macro = _macro(files, BASE, dp=4, tp=8)
    assert macro.num_rows > 0
    _assert_same(partials_of_files(files, BASE, 4, 8, 1, None), macro, exact_sums=True)
    _assert_same(partials_of_files(files, BASE, 4, 8, 1, None, chunk_rows=4_000), macro, exact_sums=False)


def test_generated_job_uses_numpy_only_on_big_segments(job):
    """50-step segments (~9 KB) go to the macro (numpy_pays: pyarrow's per-file cost outweighs it)."""
    assert not numpy_pays(_files(job, range(0, 256)))
    assert not numpy_pays([])


# ---- member rows with the hard cases -----------------------------------------------------------------

DP, TP, PP = 2, 4, 2  # 16 ranks in Megatron order


def _members() -> pd.DataFrame:
    """tp, dp, pp and world ops over 3 steps, starts on a 1 us grid (many ties), with: rank 5 absent
    (its tp group has 3 of 4 members), rank 2 naming its first tp op differently (two partial rows),
    ranks 9 and 12 issuing every world op last in the same ns (the higher rank is the last), issues
    before the time origin, a group not matched across ranks, an op without a name, a rank that
    missed one dp op (a seq gap) and rank 3 recording its dp ops a step late (first_step)."""
    gen = np.random.default_rng(11)
    rows = []
    for step in range(3):
        for rank in range(DP * TP * PP):
            if rank == 5:
                continue
            for group, ops in (("tp", 3), ("dp", 2), ("pp", 1), ("world", 1), ("custom", 1)):
                for op in range(ops):
                    seq = step * ops + op
                    if (rank, group, seq) == (7, "dp", 3):
                        continue
                    late = group == "world" and rank in (9, 12)
                    start = BASE - 5_000 + 1_000_000 * seq + 1_000 * (50 if late else int(gen.integers(0, 40)))
                    name = "tp_other" if (rank, group, seq) == (2, "tp", 0) else f"{group}_op"
                    if (group, seq) == ("pp", 1):
                        name = None
                    rows.append((rank, step + (rank == 3 and group == "dp"), group, seq, name, start,
                                 start + int(gen.integers(1, 5_000))))
    return pd.DataFrame(rows, columns=["rank", "step", "group", "seq", "op_name", "start_ns", "end_ns"])


def _write(root: Path, members: pd.DataFrame, segments: int = 2) -> list[str]:
    """Each rank's rows as `segments` segments in its folder (the second with two row groups)."""
    files = []
    for rank, rows in members.groupby("rank"):
        folder = root / "edge_collectives" / f"rank={int(rank):05d}"
        folder.mkdir(parents=True)
        cuts = np.linspace(0, len(rows), segments + 1).astype(int)
        for i, part in enumerate(rows.iloc[a:b] for a, b in zip(cuts[:-1], cuts[1:])):
            path = folder / f"seg-{i:06d}.parquet"
            pq.write_table(pa.Table.from_pandas(part, schema=EDGE_COLLECTIVES, preserve_index=False), path,
                           row_group_size=max(1, len(part) // 2))
            files.append(str(path))
    return files


@pytest.mark.parametrize("chunk_rows", [1, 40, 1 << 20])
def test_hard_cases_equal_the_macro(tmp_path, chunk_rows):
    files = _write(tmp_path, _members())
    macro = _macro(files, BASE, DP, TP)
    got = partials_of_files(files, BASE, DP, TP, 1, None, chunk_rows=chunk_rows)
    _assert_same(got, macro, exact_sums=chunk_rows > 10_000)
    frame = got.to_pandas()
    world = frame[frame["group"] == "world"]
    assert world.last_rank.tolist() == [12, 12, 12] and (world.n_events == 15).all()
    assert len(frame[(frame["group"] == "tp") & (frame.instance == 0) & (frame.seq == 0)]) == 2
    assert frame.op_name.isna().sum() == DP * TP and "custom" not in set(frame["group"])


def test_renumbered_layout_equals_the_macro(tmp_path):
    """Ranks not in Megatron order: the instances come from each rank's Megatron rank (renumber)."""
    members = _members()
    renumber = [int(r) for r in np.random.default_rng(3).permutation(DP * TP * PP)]
    files = _write(tmp_path, members, segments=1)
    _assert_same(partials_of_files(files, BASE, DP, TP, 1, renumber, chunk_rows=40),
                 _macro(files, BASE, DP, TP, renumber=renumber), exact_sums=False)


def test_what_it_does_not_take_goes_to_the_macro(tmp_path):
    files = _write(tmp_path / "ok", _members(), segments=1)
    assert partials_of_files(files, BASE, DP, TP, 1, None) is not None
    # a rank with no Megatron rank in the layout
    assert partials_of_files(files, BASE, DP, TP, 1, [0] * 8) is None
    assert partials_of_files(files, BASE, DP, TP, 1, [-1] * 16) is None
    # a damaged segment (cut short) and a segment whose rank column is not the schema's type
    cut = Path(files[3]).read_bytes()
    Path(files[3]).write_bytes(cut[: len(cut) // 2])
    assert partials_of_files(files, BASE, DP, TP, 1, None) is None
    wide = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"rank": pa.array([0], pa.int64()), "step": [0], "group": ["tp"], "seq": [0],
                             "op_name": ["x"], "start_ns": [0], "end_ns": [1]}), wide)
    assert partials_of_files([str(wide)], BASE, DP, TP, 1, None) is None
    assert partials_of_files([], BASE, DP, TP, 1, None).num_rows == 0


# ---- through the event pass ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_job(tmp_path_factory) -> Path:
    """16 ranks x 1,000 steps: 137 KB segments, the numpy path."""
    cfg = EdgeGenConfig(dp=2, tp=8, pp=1, steps=1000, faults=[])
    return generate(tmp_path_factory.mktemp("edge-partials-big") / "run", cfg, batch_ranks=16)


@pytest.mark.parametrize("batch_ranks", [ep.BATCH_RANKS, 4])
def test_event_pass_on_big_segments_equals_the_macro_merge(big_job, monkeypatch, batch_ranks):
    """A 16-rank x 1,000-step job (137 KB segments: the numpy path): from_edge_summaries' collective
    instances equal collective_instances_of over the macro's partials of the whole run; in one batch,
    and in 4 (each batch's instances split, those spread over batches merged)."""
    monkeypatch.setattr(ep, "BATCH_RANKS", batch_ranks)
    run = big_job
    files = _files(run, range(16))
    assert numpy_pays(files)
    opened = Run.open(run)
    store = opened.store
    assert ep.from_edge_summaries(store, ep.run_start_ns(store))
    base = ep.run_start_ns(store)
    store.con.register("_macro_partials", _macro(files, base, dp=2, tp=8))
    want = store.con.sql("FROM collective_instances_of('_macro_partials', $base)", params={"base": base}).df()
    got = store.query("FROM collective_instances")
    keys = ["group", "instance", "seq"]
    got, want = (f.sort_values(keys).reset_index(drop=True) for f in (got, want))
    pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-12)
    assert len(got) == 1000 * (2 * 16 + 8 * 2)  # a step: 2 tp groups x 16 all-reduces, 8 dp groups x 2 ops


def test_a_segment_damaged_mid_pass_sends_the_run_to_the_raw_events(big_job, tmp_path, monkeypatch):
    """A cut edge_collectives segment in the third of 4 batches (listed before the open-time check
    caught it): pyarrow cannot read it, so its batch goes to the macro, whose read finds and drops it;
    then from_edge_summaries leaves no table and returns False (the raw events are the truth)."""
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(big_job, copy)
    victim = sorted((copy / "edge_collectives" / "rank=00009").glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[: len(victim.read_bytes()) // 2])
    monkeypatch.setattr(ep, "BATCH_RANKS", 4)
    store = Run.open(copy).store
    assert ("edge_collectives", str(victim)) in store.damaged
    store.files["edge_collectives"].append(str(victim))  # as if listed before the check caught it
    store.files["edge_collectives"].sort()
    store.damaged.clear()
    store._excluded.discard("edge_collectives")
    store._make_view("edge_collectives")
    assert not ep.from_edge_summaries(store, ep.run_start_ns(store))
    assert store.damaged == [("edge_collectives", str(victim))]
    tables = set(store.query("SELECT table_name FROM duckdb_tables()").table_name)
    assert not tables & {"rank_step", "_p2p_peer_step", "collective_instances", "_collective_partials"}


def test_batch_files_are_the_batch_sources(job):
    """Store.batch_files lists the segments Store.batch_source reads for each batch of rank folders."""
    store = Run.open(job).store
    batches = store.rank_prefix_batches(64, ("edge_collectives",))
    assert batches is not None and len(batches) > 1
    seen: list[str] = []
    for patterns in batches:
        files = store.batch_files("edge_collectives", patterns)
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        assert rows == store.query(f"SELECT count(*) AS n FROM {store.batch_source('edge_collectives', patterns)}").n[0]
        seen += files
    assert sorted(seen) == sorted(store.files["edge_collectives"])
