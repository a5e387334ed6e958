"""The collective partials of one batch of ranks' edge_collectives rows (edge_collectives.sql's
`collective_partials_of_members`, the same rows) computed in numpy instead of DuckDB's hash aggregation.

Why: at 12,288 ranks x 1,000 steps the macro hash-aggregated 221 M member rows into 24.7 M instances,
~0.19 us a row in DuckDB (61.5 of the edge case's 159 CPU s; docs/measurements.md, "Scale (issue 28)").
Here each row's instance key (group, group instance, seq, op_name) is a dense integer instead: the group
and op_name come from the Parquet dictionaries (codes, no string is hashed), the group instance from a
table over the batch's ranks (group_instance.sql's arithmetic on the layout), and seq is dense within one
(group, instance, op_name); so every aggregate is one O(rows) numpy reduction into an array indexed by
the key (np.bincount, np.minimum.at, np.maximum.at).

The batch's files are read with pyarrow (a few threads reading ahead), ~2 M rows at a time (`CHUNK_ROWS`,
whole files), and each chunk is aggregated into its own partial rows; the rows of a (group, instance, op)
that several chunks hold are then aggregated once more (`aggregate`: a partial row is a member row with a
count), so memory is a chunk's rows, not the batch's. Small segments stay with the macro (`numpy_pays`).

`partials_of_files` returns None whenever the assumptions do not hold - a file pyarrow cannot read or
whose columns are not the schema's types, a null in a column the key or the values need, a rank with no
place in the layout, a key space much sparser than the rows - and the caller runs the SQL macro instead
(which also finds and drops a damaged segment: Store.run_with_retry)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

GROUPS = ("dp", "tp", "pp", "embedding", "cp", "world")
"""group_instance.sql's groups, in edge_collectives.sql's code order (any other group: not matched, left out)."""
_CODE = {name: i for i, name in enumerate(GROUPS)}
MEMBER_COLUMNS = ("rank", "step", "group", "seq", "op_name", "start_ns", "end_ns")
"""What is read of edge_collectives (tracer/schema.py EDGE_COLLECTIVES)."""
_INT_TYPES = {"rank": pa.int32(), "step": pa.int64(), "seq": pa.int64(), "start_ns": pa.int64(),
              "end_ns": pa.int64()}
CHUNK_ROWS = 2_000_000
"""Member rows aggregated at once (~90 MB of columns and keys), so the batch's 18 M rows (1,024 ranks x
1,000 steps x 18 collectives) are never held together."""
MAX_SPARSITY = 4
"""Key slots allowed per member row (plus SLACK_SLOTS): seq is dense per (group, instance, op) on the
tracer's counters (a group's ops share one counter, so two op kinds fill half their slots each); a key
space sparser than this (odd seq numbers) goes to the SQL macro rather than to large arrays."""
SLACK_SLOTS = 1 << 16
MIN_MEAN_SEGMENT_BYTES = 48 << 10
"""Below this mean segment size the macro is cheaper: pyarrow's ~1 ms a file outweighs the cheaper
aggregation. 1,024 ranks of edge_gen (CPU s, numpy / macro on 2 DuckDB threads, load 3-5): 29 KB
segments (200 steps) 0.9-1.1 / 0.6-0.8; 69 KB (500 steps) 1.2 / 1.8-1.9; 137 KB (1,000 steps) 2.1 / 2.4-3.6."""
READ_THREADS = 2
READ_AHEAD = 16
"""Files read ahead of the aggregation (one rank's segment is ~140 KB, 18,000 rows at 1,000 steps)."""
_INT64_MIN, _INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


@dataclass
class Rows:
    """Member rows or partial rows of collective instances, as columns (a member row: n = 1, its step,
    start, rank, (start - base) ms and end). `op` indexes the op-name list the rows are given with."""
    gcode: np.ndarray       # int64, GROUPS index
    instance: np.ndarray    # int64, group_instance.sql's
    seq: np.ndarray         # int64
    op: np.ndarray          # int64, index into op names
    n: np.ndarray | None    # int64 members; None: one each (member rows)
    first_step: np.ndarray  # int64, min(step)
    last_issue: np.ndarray  # int64, the latest issue (ns)
    last_rank: np.ndarray   # int64, its rank (the higher rank on a tie)
    issue_sum_ms: np.ndarray  # float64, sum of (issue - base) / 1e6
    last_end: np.ndarray    # int64, max(end_ns)

    def __len__(self) -> int:
        return len(self.seq)


def instance_table(ranks: np.ndarray, dp: int, tp: int, cp: int, renumber: Sequence[int] | None
                   ) -> np.ndarray | None:
    """(len(GROUPS), len(ranks)) group instances of `ranks` (group_instance.sql's arithmetic on the
    Megatron rank of each); None when a rank has no Megatron rank (outside `renumber`, or -1 there) or a
    size is not positive: the SQL macro decides those rows."""
    if min(dp, tp, cp) < 1 or (len(ranks) and ranks.min() < 0):
        return None
    if renumber is None:
        m = ranks.astype(np.int64)
    else:
        table = np.asarray(renumber, dtype=np.int64)
        if len(ranks) and ranks.max() >= len(table):
            return None
        m = table[ranks]
        if (m < 0).any():
            return None
    inner = dp * cp * tp
    return np.stack([m // inner * tp + m % tp,   # dp
                     m // tp,                    # tp
                     m % inner,                  # pp
                     m % inner,                  # embedding
                     m // (cp * tp) * tp + m % tp,  # cp
                     np.zeros_like(m)])          # world


def aggregate(rows: Rows, n_ops: int) -> Rows | None:
    """One partial row per (gcode, instance, seq, op) of `rows` (op < n_ops), edge_collectives.sql's
    aggregates: count, min(step), the last issue with the higher rank on a tie, the sum of the issue
    ms (member rows carry their (start - base) / 1e6) and max(end). None when the key space would be
    too sparse (MAX_SPARSITY) or the issues span too much to pack with the rank."""
    if not len(rows):
        return rows
    inst_bound = int(rows.instance.max()) + 1
    # (group, instance, op) as one dense code (np.unique: these are the chunks' partial rows, a few
    # hundred thousand); seq is dense within each (its own min..max)
    combined, gio = np.unique((rows.gcode * inst_bound + rows.instance) * n_ops + rows.op, return_inverse=True)
    n_gio = len(combined)
    smin = np.full(n_gio, _INT64_MAX, dtype=np.int64)
    smax = np.full(n_gio, _INT64_MIN, dtype=np.int64)
    np.minimum.at(smin, gio, rows.seq)
    np.maximum.at(smax, gio, rows.seq)
    present = smax >= smin
    span = np.where(present, smax - smin + 1, 0)
    if int(span.sum()) > MAX_SPARSITY * len(rows) + SLACK_SLOTS:
        return None
    end = np.cumsum(span)
    start = end - span
    key = (start - np.where(present, smin, 0))[gio] + rows.seq
    del gio
    slots = int(end[-1])
    return _reduce(rows, key, slots, (start, end, smin, combined, inst_bound, n_ops))


def _reduce(rows: Rows, key: np.ndarray, slots: int, layout: tuple) -> Rows | None:
    """The aggregates of `rows` by the dense `key` (0 <= key < slots), decoded back to their columns."""
    start, end, smin, combined, inst_bound, n_ops = layout
    if rows.n is None:
        count = np.bincount(key, minlength=slots)
    else:  # partial rows: counts add (exact: far below 2^53)
        count = np.rint(np.bincount(key, weights=rows.n, minlength=slots)).astype(np.int64)
    first = np.full(slots, _INT64_MAX, dtype=np.int64)
    np.minimum.at(first, key, rows.first_step)
    # (issue, rank) as one number: (issue - earliest) * 2^bits + rank, so its max is the latest issue,
    # then the higher rank (edge_collectives.sql's HUGEINT key, in 63 bits while the issues span < 2^(63-bits))
    if rows.last_rank.min() < 0:
        return None
    bits = max(1, int(rows.last_rank.max()).bit_length())
    issue0 = int(rows.last_issue.min())
    if int(rows.last_issue.max()) - issue0 >= 1 << (62 - bits):
        return None
    packed = ((rows.last_issue - issue0) << bits) | rows.last_rank
    last = np.full(slots, -1, dtype=np.int64)
    np.maximum.at(last, key, packed)
    del packed
    sums = np.bincount(key, weights=rows.issue_sum_ms, minlength=slots)
    ends = np.full(slots, _INT64_MIN, dtype=np.int64)
    np.maximum.at(ends, key, rows.last_end)
    hit = np.flatnonzero(count)
    gio = np.searchsorted(end, hit, side="right")
    seq = hit - start[gio] + smin[gio]
    gi, op = np.divmod(combined[gio], n_ops)
    gcode, instance = np.divmod(gi, inst_bound)
    return Rows(gcode, instance, seq, op, count[hit], first[hit], (last[hit] >> bits) + issue0,
                last[hit] & ((1 << bits) - 1), sums[hit], ends[hit])


def concat(parts: list[Rows]) -> Rows:
    """The partial rows of several chunks as one (their op codes index the same list)."""
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])
    ones = [p.n if p.n is not None else np.ones(len(p), dtype=np.int64) for p in parts]
    return Rows(cat("gcode"), cat("instance"), cat("seq"), cat("op"), np.concatenate(ones), cat("first_step"),
                cat("last_issue"), cat("last_rank"), cat("issue_sum_ms"), cat("last_end"))


class _Reader:
    """The batch's member rows read a chunk of files at a time and aggregated per chunk (`chunks`),
    with the op names seen so far (the rows' op codes index `ops`; a code never changes meaning)."""

    def __init__(self, files: list[str], base: int, layout: tuple[int, int, int, Sequence[int] | None],
                 chunk_rows: int) -> None:
        self.files, self.base, self.layout, self.chunk_rows = files, base, layout, chunk_rows
        self.ops: list[str | None] = []
        self._op_code: dict[str | None, int] = {}

    def op_code(self, name: str | None) -> int:
        if name not in self._op_code:
            self._op_code[name] = len(self.ops)
            self.ops.append(name)
        return self._op_code[name]

    def chunks(self) -> Iterator[_Part | None]:
        """Each chunk's partial rows (CHUNK_ROWS member rows or so, whole files); None: this batch is
        not for numpy (the caller stops)."""
        pending: list[pa.RecordBatch] = []
        rows = 0
        for table in _prefetched(self.files):
            if table is None:
                yield None
                return
            pending.extend(b for b in table.to_batches() if b.num_rows)
            rows += table.num_rows
            if rows >= self.chunk_rows:
                yield _Chunk(self, pending).partials()
                pending, rows = [], 0
        if pending:
            yield _Chunk(self, pending).partials()


class _Chunk:
    """One chunk's member rows, a record batch (one rank's rows, one segment's row group) at a time:
    small arrays that stay in cache, each batch's (group, instance, op) codes from a table of its
    dictionaries' few values (a rank is one instance of each group), aggregated into the chunk's
    dense slots: per (group, instance, op) code the seq range it holds."""

    def __init__(self, reader: _Reader, batches: list[pa.RecordBatch]) -> None:
        self.reader, self.batches = reader, batches
        self.gio: dict[tuple[int, int, int], int] = {}
        """(gcode, instance, op) -> dense code in this chunk."""

    def _code(self, key: tuple[int, int, int]) -> int:
        return self.gio.setdefault(key, len(self.gio))

    def _codes(self, batch: pa.RecordBatch) -> tuple[np.ndarray, int] | None:
        """Per-row dense (group, instance, op) codes of one record batch (-1: a group not matched) and
        its rank; None when its rank is not one value or has no place in the layout."""
        rank = batch.column(0).to_numpy()
        r = int(rank[0])
        if rank.min() != r or rank.max() != r:
            return None
        inst = instance_table(np.array([r]), *self.reader.layout)
        if inst is None:
            return None
        group, op = _dictionary(batch.column(2)), _dictionary(batch.column(4))
        if group is None or op is None:
            return None
        gnames = group.dictionary.to_pylist() + [None]  # the last: a null row
        onames = [self.reader.op_code(v) for v in op.dictionary.to_pylist() + [None]]
        lut = np.array([-1 if _CODE.get(g, -1) < 0 else self._code((_CODE[g], int(inst[_CODE[g], 0]), o))
                        for g in gnames for o in onames], dtype=np.int64)
        gi, oi = group.indices, op.indices
        gi = (gi.fill_null(len(gnames) - 1) if gi.null_count else gi).to_numpy()
        oi = (oi.fill_null(len(onames) - 1) if oi.null_count else oi).to_numpy()
        return lut[gi.astype(np.int64) * len(onames) + oi], r

    def partials(self) -> _Part | None:
        """The chunk's partial rows (edge_collectives.sql's aggregates); None: not for numpy."""
        units = []
        for batch in self.batches:
            if any(batch.column(i).null_count for i in (0, 1, 3, 5, 6)):  # rank, step, seq, start, end
                return None
            coded = self._codes(batch)
            if coded is None:
                return None
            code, rank = coded
            cols = [batch.column(i).to_numpy() for i in (1, 3, 5, 6)]  # step, seq, start, end
            if (code < 0).any():  # rows of groups not matched across ranks: left out, as the SQL's
                keep = code >= 0
                code, cols = code[keep], [c[keep] for c in cols]
            if len(code):
                units.append((code, rank, *cols))
        if not units:
            return _Part(_empty(), np.zeros(0, dtype=np.int64), [])
        n = len(self.gio)
        smin = np.full(n, _INT64_MAX, dtype=np.int64)
        smax = np.full(n, _INT64_MIN, dtype=np.int64)
        for code, _, _, seq, _, _ in units:
            np.minimum.at(smin, code, seq)
            np.maximum.at(smax, code, seq)
        present = smax >= smin
        span = np.where(present, smax - smin + 1, 0)
        total = sum(len(u[0]) for u in units)
        slots = int(span.sum())
        if slots > MAX_SPARSITY * total + SLACK_SLOTS:
            return None
        end = np.cumsum(span)
        offset = end - span - np.where(present, smin, 0)  # slot = offset[code] + seq
        ranks = np.array([u[1] for u in units])
        bits = max(1, int(ranks.max()).bit_length())
        issue0 = min(int(u[4].min()) for u in units)
        if ranks.min() < 0 or max(int(u[4].max()) for u in units) - issue0 >= 1 << (62 - bits):
            return None
        count = np.zeros(slots, dtype=np.int64)
        first = np.full(slots, _INT64_MAX, dtype=np.int64)
        last = np.full(slots, -1, dtype=np.int64)
        sums = np.zeros(slots, dtype=np.float64)
        ends = np.full(slots, _INT64_MIN, dtype=np.int64)
        base = self.reader.base
        for code, rank, step, seq, start, stop in units:
            key = offset[code]
            key += seq
            np.add.at(count, key, 1)
            np.minimum.at(first, key, step)
            # (issue, rank) as one number, (issue - earliest) * 2^bits + rank: its max is the latest
            # issue, then the higher rank (edge_collectives.sql's HUGEINT key, in 63 bits)
            np.maximum.at(last, key, ((start - issue0) << bits) | rank)
            np.add.at(sums, key, (start - base) / 1e6)  # as the SQL: a BIGINT difference, a DOUBLE division
            np.maximum.at(ends, key, stop)
        hit = np.flatnonzero(count)
        gio = np.searchsorted(end, hit, side="right")
        keys = np.array(list(self.gio), dtype=np.int64).reshape(-1, 3)
        rows = Rows(keys[gio, 0], keys[gio, 1], hit - offset[gio], keys[gio, 2], count[hit], first[hit],
                    (last[hit] >> bits) + issue0, last[hit] & ((1 << bits) - 1), sums[hit], ends[hit])
        return _Part(rows, gio, list(self.gio))


@dataclass
class _Part:
    """One chunk's partial rows, with each row's (group, instance, op) code in the chunk (`gio`,
    indexing `keys`): an instance whose (group, instance, op) no other chunk has is final here."""
    rows: Rows
    gio: np.ndarray
    keys: list[tuple[int, int, int]]

    def split(self, shared: set[tuple[int, int, int]]) -> tuple[Rows, Rows]:
        """(rows no other chunk can add to, rows to merge with other chunks')."""
        merge = np.array([k in shared for k in self.keys], dtype=bool)[self.gio]
        return _take(self.rows, ~merge), _take(self.rows, merge)


def _take(rows: Rows, mask: np.ndarray) -> Rows:
    return Rows(rows.gcode[mask], rows.instance[mask], rows.seq[mask], rows.op[mask],
                None if rows.n is None else rows.n[mask], rows.first_step[mask], rows.last_issue[mask],
                rows.last_rank[mask], rows.issue_sum_ms[mask], rows.last_end[mask])


def _dictionary(column: pa.Array) -> pa.DictionaryArray | None:
    """A string column as a dictionary array (as read: read_dictionary), None for another type."""
    if pa.types.is_dictionary(column.type):
        return column if pa.types.is_string(column.type.value_type) else None
    return column.dictionary_encode() if pa.types.is_string(column.type) else None


def _empty() -> Rows:
    z = np.zeros(0, dtype=np.int64)
    return Rows(z, z, z, z, z, z, z, z, np.zeros(0), z)


def _prefetched(files: list[str]) -> Iterator[pa.Table | None]:
    """`_read` of each file in order, READ_AHEAD files read ahead by READ_THREADS threads (pyarrow
    decodes without the GIL: the reads overlap the aggregation, as DuckDB's threads do)."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        ahead: deque[Future[pa.Table | None]] = deque()
        for path in files:
            ahead.append(pool.submit(_read, path))
            if len(ahead) > READ_AHEAD:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def _read(path: str) -> pa.Table | None:
    """One segment's member columns (group and op_name as dictionaries); None when pyarrow cannot read
    it or a column is not the schema's type."""
    try:
        # one thread, no pre-buffering: ~15% fewer CPU s on these small files (1,000 files, best of 4)
        table = pq.ParquetFile(path, read_dictionary=["group", "op_name"], pre_buffer=False).read(
            columns=list(MEMBER_COLUMNS), use_threads=False)
        table = table.select(list(MEMBER_COLUMNS))  # the order _Chunk indexes
    except (OSError, pa.ArrowException, ValueError, KeyError):
        return None
    for name, kind in _INT_TYPES.items():
        if table.schema.field(name).type != kind:
            return None
    for name in ("group", "op_name"):
        t = table.schema.field(name).type
        if not (pa.types.is_dictionary(t) and pa.types.is_string(t.value_type)) and not pa.types.is_string(t):
            return None
    return table


def release_unused() -> None:
    """Hand back what pyarrow's memory pool kept of a batch's reads (~120 MB at 1,024 ranks x 1,000
    steps: RSS 265 -> 142 MiB after one batch), so it does not sit beside DuckDB's tables."""
    pa.default_memory_pool().release_unused()


def numpy_pays(files: list[str]) -> bool:
    """Whether the batch's segments are big enough for the numpy path (MIN_MEAN_SEGMENT_BYTES)."""
    try:
        total = sum(os.path.getsize(f) for f in files)
    except OSError:
        return False
    return bool(files) and total >= MIN_MEAN_SEGMENT_BYTES * len(files)


def partials_of_files(files: list[str], base: int, dp: int, tp: int, cp: int, renumber: Sequence[int] | None,
                      chunk_rows: int = CHUNK_ROWS) -> pa.Table | None:
    """edge_collectives.sql's partial rows (its columns and types) of the member rows in `files`, or
    None when the numpy path does not apply (the caller runs the macro). Member rows are aggregated
    `chunk_rows` or so at a time (whole files)."""
    reader = _Reader(files, int(base), (dp, tp, cp, renumber), chunk_rows)
    parts: list[_Part] = []
    for part in reader.chunks():
        if part is None:
            return None
        parts.append(part)
    n_ops = max(1, len(reader.ops))
    # only the (group, instance, op) codes that several chunks hold are merged (a chunk boundary inside a
    # tensor-parallel group, the data-parallel groups): most instances are whole in their chunk
    seen: dict[tuple[int, int, int], int] = {}
    for part in parts:
        for k in part.keys:
            seen[k] = seen.get(k, 0) + 1
    shared = {k for k, n in seen.items() if n > 1}
    pieces = [part.split(shared) if shared else (part.rows, _empty()) for part in parts]
    merged = aggregate(concat([m for _, m in pieces]), n_ops) if shared else _empty()
    if merged is None:
        return None
    # the pieces as record batches of one table (not concatenated: DuckDB reads them as they are)
    return pa.Table.from_batches([_batch(rows, reader.ops) for rows in [d for d, _ in pieces] + [merged]],
                                 schema=PARTIALS_SCHEMA)


PARTIALS_SCHEMA = pa.schema([
    ("group", pa.string()), ("instance", pa.int64()), ("seq", pa.int64()), ("first_step", pa.int64()),
    ("op_name", pa.string()), ("n_events", pa.int64()), ("last_rank", pa.int32()), ("last_issue_ns", pa.int64()),
    ("issue_sum_ms", pa.float64()), ("last_end_ns", pa.int64())])
"""edge_collectives.sql's columns and types (flat_partials.sql's)."""


def _batch(rows: Rows, ops: list[str | None]) -> pa.RecordBatch:
    """Partial rows as PARTIALS_SCHEMA's record batch (group and op_name from their codes)."""
    group = pa.DictionaryArray.from_arrays(pa.array(rows.gcode.astype(np.int32)), pa.array(list(GROUPS)))
    names = pa.array(ops if ops else [None], type=pa.string())
    op_name = pa.DictionaryArray.from_arrays(pa.array(rows.op.astype(np.int32)), names)
    n = rows.n if rows.n is not None else np.ones(len(rows), dtype=np.int64)
    return pa.RecordBatch.from_arrays(
        [group.cast(pa.string()), pa.array(rows.instance), pa.array(rows.seq), pa.array(rows.first_step),
         op_name.cast(pa.string()), pa.array(n), pa.array(rows.last_rank.astype(np.int32)),
         pa.array(rows.last_issue), pa.array(rows.issue_sum_ms), pa.array(rows.last_end)], schema=PARTIALS_SCHEMA)
