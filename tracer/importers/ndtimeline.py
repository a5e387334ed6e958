"""Import NDTimeline-style Parquet (MegaScale's open-sourced timer; the public what-if straggler
artifact): one row per timed op with columns dp_rank, stage, rank, step, optype, start_ts, duration
(float seconds), seq_id, mc (model chunk in the stage), gmc (global chunk), mb_id; job sizes (dp, pp,
tp, vpp, world) from a small YAML file among the sources or from the command line.

The conversion is one DuckDB query (sorting and numbering spill to disk, so memory stays bounded):
optypes map to our event names (docs/importers.md has the table), p2p peers are the worker of the
neighbouring stage in the same data-parallel replica, sequence numbers count each rank's ops per group
(collectives) or per peer and direction (p2p) in time order, as the tracer numbers them.
Such traces often hold one worker per (dp, stage) rather than every tensor-parallel rank; the run then
lists only those workers in its topology.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from megascope.tracer.importers.layout import Layout
from megascope.tracer.importers.writer import ImportInputError, RunWriter

REQUIRED = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration")
OPTIONAL = {"seq_id": -1, "mc": -1, "gmc": -1, "mb_id": -1}

# optype -> (our name, kind, group, peer stage offset: +1 next stage, -1 previous, 0 none)
OPTYPES: list[tuple[str, str, str, str, int]] = [
    ("forward-compute", "forward", "compute", "", 0),
    ("backward-compute", "backward", "compute", "", 0),
    ("forward-send", "send_forward", "p2p", "pp", 1),
    ("forward-recv", "recv_forward", "p2p", "pp", -1),
    ("backward-send", "send_backward", "p2p", "pp", -1),
    ("backward-recv", "recv_backward", "p2p", "pp", 1),
    ("forward-send-backward-recv", "send_forward", "p2p", "pp", 1),
    ("forward-send-backward-recv", "recv_backward", "p2p", "pp", 1),
    ("backward-send-forward-recv", "send_backward", "p2p", "pp", -1),
    ("backward-send-forward-recv", "recv_forward", "p2p", "pp", -1),
    ("grads-reduce-scatter", "reduce_scatter", "collective", "dp", 0),
    ("params-all-gather", "all_gather", "collective", "dp", 0),
    ("separate-grads-all-reduce", "all_reduce", "collective", "dp", 0),
    ("embedding-grads-all-reduce", "embedding_all_reduce", "collective", "pp", 0),
    ("layernorm-grads-all-reduce", "layernorm_all_reduce", "collective", "tp", 0),
    ("optimizer", "optimizer", "compute", "", 0),
    ("optimizer-clip-main-grad", "optimizer_clip_main_grad", "compute", "", 0),
    ("gc", "gc", "host", "", 0),
]


def read_job_sizes(path: Path) -> dict[str, int]:
    """The job-size YAML (flat `key: value` lines: dp, pp, tp, vpp, world); no YAML dependency."""
    sizes: dict[str, int] = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line or line == "---":
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise ImportInputError(f"{path}:{number}: expected 'key: value' (job sizes dp, pp, tp, vpp, world), "
                                   f"got {line!r}")
        key, value = key.strip().lower(), value.strip().strip("'\"")
        if key in ("dp", "pp", "tp", "vpp", "world", "world_size"):
            try:
                sizes["world" if key == "world_size" else key] = int(value)
            except ValueError:
                raise ImportInputError(f"{path}:{number}: {key} must be an integer, got {value!r}") from None
    return sizes


def _check_columns(path: Path, renames: dict[str, str]) -> dict[str, str]:
    """Our column name -> the file's column name; a clear error naming what is missing."""
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowInvalid, OSError) as exc:
        raise ImportInputError(f"{path} is not a readable Parquet file ({str(exc).splitlines()[0][:120]}); "
                               f"NDTimeline dumps are Parquet with columns {', '.join(REQUIRED)}") from None
    mapping = {}
    missing = []
    for col in (*REQUIRED, *OPTIONAL):
        actual = renames.get(col, col)
        if actual in names:
            mapping[col] = actual
        elif col in REQUIRED:
            close = difflib.get_close_matches(col, names, n=1, cutoff=0.5)
            missing.append(f"{col}" + (f" (found '{close[0]}': pass --column {col}={close[0]})" if close else ""))
    if missing:
        raise ImportInputError(f"{path}: missing column(s) {'; '.join(missing)}. Expected NDTimeline columns "
                               f"{', '.join(REQUIRED)} (+ optional {', '.join(OPTIONAL)}); the file has "
                               f"{', '.join(names)}")
    return mapping


def _select(path: Path, mapping: dict[str, str]) -> str:
    quoted = str(path).replace("'", "''")
    cols = []
    for col in (*REQUIRED, *OPTIONAL):
        if col in mapping:
            cols.append(f'"{mapping[col]}" AS {col}')
        else:
            cols.append(f"{OPTIONAL[col]} AS {col}")
    return f"SELECT {', '.join(cols)} FROM read_parquet('{quoted}')"


_CONVERT = """
WITH src AS ({source}),
ops(optype, name, kind, grp, peer_off) AS (VALUES {ops}),
workers AS (SELECT dp_rank, stage, min(rank) AS wrank FROM src GROUP BY ALL),
ev AS (
    SELECT CAST(s.rank AS INTEGER) AS rank, CAST(s.step AS BIGINT) AS step,
        CAST(s.mb_id AS INTEGER) AS microbatch, CAST(s.mc AS SMALLINT) AS chunk,
        coalesce(o.name, s.optype) AS name, coalesce(o.kind, 'host') AS kind, coalesce(o.grp, '') AS "group",
        CASE WHEN o.peer_off IS NULL OR o.peer_off = 0 THEN -1
             ELSE coalesce(w.wrank, -1) END AS peer,
        CAST(round(s.start_ts * 1e9) AS BIGINT) AS start_ns,
        CAST(round((s.start_ts + s.duration) * 1e9) AS BIGINT) AS end_ns
    FROM src s
    LEFT JOIN ops o ON o.optype = s.optype
    LEFT JOIN workers w ON w.dp_rank = s.dp_rank AND w.stage = (s.stage + coalesce(o.peer_off, 0) + {pp}) % {pp}
)
SELECT rank, step, microbatch, chunk, name, kind, "group",
    CASE WHEN kind = 'compute' OR kind = 'host' THEN -1
         WHEN kind = 'p2p' THEN row_number() OVER (PARTITION BY rank, peer, name LIKE 'send%' ORDER BY start_ns) - 1
         ELSE row_number() OVER (PARTITION BY rank, "group", kind ORDER BY start_ns) - 1 END AS seq,
    CAST(peer AS INTEGER) AS peer, CAST(0 AS BIGINT) AS bytes, start_ns AS issue_ns, start_ns, end_ns
FROM ev
ORDER BY rank, start_ns
"""


def import_ndtimeline(sources: list[Path], writer: RunWriter, dp: int | None, tp: int | None, pp: int | None,
                      vpp: int | None, renames: dict[str, str]) -> tuple[Layout, list[int]]:
    """Convert the Parquet files (and job-size YAML) in `sources`; returns the layout and ranks written."""
    yamls = [p for p in sources if p.suffix.lower() in (".yaml", ".yml")]
    tables = [p for p in sources if p not in yamls]
    if not tables:
        raise ImportInputError("no NDTimeline Parquet file among the sources (only job-size YAML was given)")
    sizes: dict[str, int] = {}
    for y in yamls:
        sizes.update(read_job_sizes(y))
        writer.add_source(y, kind="job sizes")
    mappings = {p: _check_columns(p, renames) for p in tables}
    for p in tables:
        writer.add_source(p, kind="ndtimeline parquet")
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order=true")
    source = " UNION ALL ".join(_select(p, m) for p, m in mappings.items())
    layout = _layout(con, source, sizes, dp, tp, pp, vpp)
    _check_workers(con, source, layout, writer)
    ops = ", ".join(f"('{t}', '{n}', '{k}', '{g}', {o})" for t, n, k, g, o in OPTYPES)
    unknown = con.execute(f"SELECT DISTINCT optype FROM ({source}) WHERE optype NOT IN "
                          f"({', '.join(repr(t) for t, *_ in OPTYPES)})").fetchall()
    if unknown:
        writer.warn(f"unknown optypes kept as host spans: {', '.join(sorted(str(u[0]) for u in unknown))}")
    reader = con.sql(_CONVERT.format(source=source, ops=ops, pp=layout.pp)).to_arrow_reader(200_000)
    ranks: set[int] = set()
    for batch in reader:
        table = pa.Table.from_batches([batch])
        rank_col = table.column("rank").to_numpy()
        for rank in sorted(set(int(r) for r in rank_col)):
            part = table.filter(pc.equal(table.column("rank"), rank))
            writer.table(rank, "events", part)
            ranks.add(rank)
    steps = con.sql(f"""SELECT CAST(rank AS INTEGER) AS rank, CAST(step AS BIGINT) AS step,
                   CAST(round(min(start_ts) * 1e9) AS BIGINT) AS start_ns,
                   CAST(round(max(start_ts + duration) * 1e9) AS BIGINT) AS end_ns,
                   CAST(0 AS BIGINT) AS tokens, CAST('nan' AS DOUBLE) AS loss, CAST('nan' AS DOUBLE) AS lr,
                   CAST('nan' AS DOUBLE) AS grad_norm, CAST(0 AS DOUBLE) AS model_flops,
                   CAST(0 AS BIGINT) AS dropped_events
            FROM ({source}) GROUP BY rank, step ORDER BY rank, step""").to_arrow_table()
    for rank in sorted(ranks):
        writer.table(rank, "steps", steps.filter(pc.equal(steps.column("rank"), rank)))
    return layout, sorted(ranks)


def _layout(con: duckdb.DuckDBPyConnection, source: str, sizes: dict[str, int], dp: int | None,
            tp: int | None, pp: int | None, vpp: int | None) -> Layout:
    seen_dp, seen_pp, max_rank = con.execute(
        f"SELECT max(dp_rank) + 1, max(stage) + 1, max(rank) FROM ({source})").fetchone()
    if seen_dp is None:
        raise ImportInputError("the NDTimeline files hold no rows")
    dp = dp or sizes.get("dp") or int(seen_dp)
    pp = pp or sizes.get("pp") or int(seen_pp)
    world = sizes.get("world")
    tp = tp or sizes.get("tp") or (world // (dp * pp) if world else None) or max(1, -(-(int(max_rank) + 1) // (dp * pp)))
    layout = Layout(dp=dp, tp=tp, pp=pp, vpp=vpp or sizes.get("vpp") or 1)
    if world and world != layout.world:
        raise ImportInputError(f"job sizes disagree: dp={dp} x tp={tp} x pp={pp} = {layout.world}, world={world}; "
                               "fix the YAML or pass --dp/--tp/--pp")
    if seen_dp > dp or seen_pp > pp:
        raise ImportInputError(f"the trace has dp_rank up to {seen_dp - 1} and stage up to {seen_pp - 1}, more than "
                               f"dp={dp}, pp={pp}; pass the job's sizes with --dp/--pp or a YAML file")
    return layout


def _check_workers(con: duckdb.DuckDBPyConnection, source: str, layout: Layout, writer: RunWriter) -> None:
    """Each rank must sit at its (dp_rank, stage) in Megatron order; missing workers are reported."""
    rows = con.execute(f"SELECT DISTINCT rank, dp_rank, stage FROM ({source})").fetchall()
    for rank, dp_rank, stage in rows:
        if rank < 0 or rank >= layout.world:
            raise ImportInputError(f"rank {rank} is outside the world of {layout.world} ranks "
                                   f"(dp={layout.dp} x tp={layout.tp} x pp={layout.pp}); pass the job's sizes")
        pp_c, dp_c, _ = layout.coords(int(rank))
        if (pp_c, dp_c) != (int(stage), int(dp_rank)):
            raise ImportInputError(f"rank {rank} is at dp_rank={dp_rank}, stage={stage} in the trace, but at "
                                   f"dp={dp_c}, stage={pp_c} in Megatron rank order for dp={layout.dp}, "
                                   f"tp={layout.tp}, pp={layout.pp}; pass the job's real --dp/--tp/--pp")
    present = {(int(d), int(s)) for _, d, s in rows}
    missing = [(d, s) for s in range(layout.pp) for d in range(layout.dp) if (d, s) not in present]
    if missing:
        shown = ", ".join(f"dp={d}/stage={s}" for d, s in missing[:8])
        writer.warn(f"no rows for {len(missing)} worker(s) ({shown}{', ...' if len(missing) > 8 else ''}); "
                    "the others are imported")
