"""Import NDTimeline-style Parquet (MegaScale's open-sourced timer; the public what-if straggler
artifact): one row per timed op with columns dp_rank, stage, rank, step, optype, start_ts, duration
(float seconds), seq_id, mc (model chunk in the stage), gmc (global chunk), mb_id; job sizes (dp, pp,
tp, cp, vpp, world) from the command line, from the job file (`--meta job.yaml`, or a YAML file among
the sources: NDTimeline's `dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size` or the short
names), or inferred from the ranks. `dsp_size` (sequence parallelism across ranks) is context
parallelism: cp, Megatron order tp, cp, dp, pp.

The conversion is one DuckDB query (sorting and numbering spill to disk, so memory stays bounded):
optypes map to our event names (docs/importers.md has the table), p2p peers are the worker of the
neighbouring stage at the same position in the same data-parallel replica (same cp and tp
coordinates; the replica's one worker there when the trace holds one per (dp, stage)), sequence numbers
count each rank's ops per group (collectives) or per peer and direction (p2p) in step order, then time
order, as the tracer numbers them (by time alone, a sampled trace whose every step starts at 0, as the
What-if artifact's do, interleaved its steps and matched sends to another step's receives).
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

from megascope.tracer.importers.layout import sizes_text
from megascope.tracer.importers.writer import ImportInputError, RunWriter
from megascope.tracer.layout import Layout

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
    ("optimizer-clip-main-grad", "optimizer_clip_main_grad", "collective", "world", 0),
    ("gc", "gc", "host", "", 0),
]


JOB_KEYS = {"dp": "dp", "dp_size": "dp", "data_parallel_size": "dp",
            "pp": "pp", "pp_size": "pp", "pipeline_model_parallel_size": "pp",
            "tp": "tp", "tp_size": "tp", "tensor_model_parallel_size": "tp",
            "cp": "cp", "cp_size": "cp", "dsp": "cp", "dsp_size": "cp", "context_parallel_size": "cp",
            "vpp": "vpp", "vpp_size": "vpp", "virtual_pipeline_model_parallel_size": "vpp",
            "world": "world", "world_size": "world"}
"""Job-file keys -> our size names: NDTimeline's (dp_size, ..., dsp_size = sequence/context parallel),
Megatron's argument names and the short ones."""


def read_job_sizes(path: Path) -> dict[str, int]:
    """Job sizes from a job file: every `key: value` line whose key is in JOB_KEYS, at any indentation
    (a real job file holds much more; other lines are skipped, so no YAML dependency is needed). A
    size given twice with different values, or a value that is not an integer, is an error."""
    sizes: dict[str, int] = {}
    origin: dict[str, str] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise ImportInputError(f"{path}: cannot read the job file ({exc.strerror or exc})") from None
    for number, line in enumerate(text.splitlines(), 1):
        key, sep, value = line.split("#", 1)[0].strip().lstrip("- ").partition(":")
        name = JOB_KEYS.get(key.strip().lower()) if sep else None
        value = value.strip().strip("'\"")
        if name is None or value.lower() in ("", "null", "none", "~"):
            continue
        try:
            number_value = int(value)
        except ValueError:
            raise ImportInputError(f"{path}:{number}: {key.strip()} must be an integer, got {value!r}") from None
        if number_value < 1:
            raise ImportInputError(f"{path}:{number}: {key.strip()} must be >= 1, got {number_value}")
        if name in sizes and sizes[name] != number_value:
            raise ImportInputError(f"{path}:{number}: {key.strip()}: {number_value} contradicts {origin[name]}: "
                                   f"{sizes[name]} earlier in the file; fix the job file")
        sizes[name], origin[name] = number_value, key.strip()
    if not sizes:
        raise ImportInputError(f"{path}: no job sizes found (expected keys such as dp_size, pp_size, tp_size, "
                               "dsp_size, vpp_size, world_size); pass --dp/--tp/--pp/--cp instead")
    return sizes


def merge_sizes(flags: dict[str, int | None], sizes: dict[str, int], source: str) -> dict[str, int | None]:
    """Command-line sizes completed by the job file's; a flag that contradicts the file is refused."""
    out = dict(flags)
    for name, value in sizes.items():
        if name == "world":
            continue
        given = flags.get(name)
        if given is not None and given != value:
            raise ImportInputError(f"--{name} {given} contradicts {name}={value} in {source}; "
                                   f"drop --{name} or fix the job file")
        out[name] = value
    return out


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
ranks AS (SELECT DISTINCT dp_rank, stage, rank, rank % {inner} AS pos FROM src),
workers AS (SELECT dp_rank, stage, min(rank) AS wrank FROM ranks GROUP BY ALL),
ev AS (
    SELECT CAST(s.rank AS INTEGER) AS rank, CAST(s.step AS BIGINT) AS step,
        CAST(s.mb_id AS INTEGER) AS microbatch, CAST(s.mc AS SMALLINT) AS chunk,
        coalesce(o.name, s.optype) AS name, coalesce(o.kind, 'host') AS kind, coalesce(o.grp, '') AS "group",
        CASE WHEN o.peer_off IS NULL OR o.peer_off = 0 THEN -1
             ELSE coalesce(x.rank, w.wrank, -1) END AS peer,
        CAST(round(s.start_ts * 1e9) AS BIGINT) AS start_ns,
        CAST(round((s.start_ts + s.duration) * 1e9) AS BIGINT) AS end_ns
    FROM src s
    LEFT JOIN ops o ON o.optype = s.optype
    LEFT JOIN ranks x ON x.dp_rank = s.dp_rank AND x.stage = (s.stage + coalesce(o.peer_off, 0) + {pp}) % {pp}
        AND x.pos = s.rank % {inner}
    LEFT JOIN workers w ON w.dp_rank = s.dp_rank AND w.stage = (s.stage + coalesce(o.peer_off, 0) + {pp}) % {pp}
)
SELECT rank, step, microbatch, chunk, name, kind, "group",
    CASE WHEN kind = 'compute' OR kind = 'host' THEN -1
         WHEN kind = 'p2p' THEN
             row_number() OVER (PARTITION BY rank, peer, name LIKE 'send%' ORDER BY step, start_ns) - 1
         ELSE row_number() OVER (PARTITION BY rank, "group", kind ORDER BY step, start_ns) - 1 END AS seq,
    CAST(peer AS INTEGER) AS peer, CAST(0 AS BIGINT) AS bytes, start_ns AS issue_ns, start_ns, end_ns
FROM ev
ORDER BY rank, start_ns
"""


def import_ndtimeline(sources: list[Path], writer: RunWriter, dp: int | None, tp: int | None, pp: int | None,
                      vpp: int | None, renames: dict[str, str], cp: int | None = None,
                      meta: Path | None = None) -> tuple[Layout, list[int]]:
    """Convert the Parquet files in `sources` (job files: `meta` and any YAML among the sources);
    returns the layout and ranks written."""
    yamls = [p for p in sources if p.suffix.lower() in (".yaml", ".yml")] + ([Path(meta)] if meta else [])
    tables = [p for p in sources if p.suffix.lower() not in (".yaml", ".yml")]
    if not tables:
        raise ImportInputError("no NDTimeline Parquet file among the sources (only job-size YAML was given)")
    flags: dict[str, int | None] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "vpp": vpp}
    sizes: dict[str, int] = {}
    for y in yamls:
        found = read_job_sizes(y)
        flags = merge_sizes(flags, found, y.name)
        if "world" in found and sizes.get("world", found["world"]) != found["world"]:
            raise ImportInputError(f"{y.name}: world_size {found['world']} contradicts world_size {sizes['world']} "
                                   "of another job file; pass one job file")
        sizes.update(found)
        writer.add_source(y, kind="job sizes")
    dp, tp, pp, cp, vpp = (flags[k] for k in ("dp", "tp", "pp", "cp", "vpp"))
    mappings = {p: _check_columns(p, renames) for p in tables}
    for p in tables:
        writer.add_source(p, kind="ndtimeline parquet")
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order=true")
    source = " UNION ALL ".join(_select(p, m) for p, m in mappings.items())
    layout = _layout(con, source, sizes.get("world"), dp, tp, pp, vpp, cp)
    _check_workers(con, source, layout, writer)
    ops = ", ".join(f"('{t}', '{n}', '{k}', '{g}', {o})" for t, n, k, g, o in OPTYPES)
    unknown = con.execute(f"SELECT DISTINCT optype FROM ({source}) WHERE optype NOT IN "
                          f"({', '.join(repr(t) for t, *_ in OPTYPES)})").fetchall()
    if unknown:
        writer.warn(f"unknown optypes kept as host spans: {', '.join(sorted(str(u[0]) for u in unknown))}")
    reader = con.sql(_CONVERT.format(source=source, ops=ops, pp=layout.pp,
                                     inner=layout.tp * layout.cp)).to_arrow_reader(200_000)
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


def _layout(con: duckdb.DuckDBPyConnection, source: str, world: int | None, dp: int | None,
            tp: int | None, pp: int | None, vpp: int | None, cp: int | None) -> Layout:
    row = con.execute(f"SELECT max(dp_rank) + 1, max(stage) + 1, max(rank) FROM ({source})").fetchone()
    assert row is not None  # an aggregate without GROUP BY returns one row
    seen_dp, seen_pp, max_rank = row
    if seen_dp is None:
        raise ImportInputError("the NDTimeline files hold no rows")
    dp = dp or int(seen_dp)
    pp = pp or int(seen_pp)
    cp = cp or 1
    tp = tp or (world // (dp * cp * pp) if world else None) or max(1, -(-(int(max_rank) + 1) // (dp * cp * pp)))
    layout = Layout(dp=dp, tp=tp, pp=pp, vpp=vpp or 1, cp=cp)
    if world and world != layout.world:
        hint = ""
        if world % layout.world == 0 and cp == 1:
            hint = (f" (a job with context/sequence parallelism, dsp_size in NDTimeline job files? pass "
                    f"--cp {world // layout.world} or --meta JOB.yaml)")
        raise ImportInputError(f"job sizes disagree: {sizes_text(layout)} = {layout.world}, world={world}{hint}; "
                               "fix the job file or pass --dp/--tp/--pp/--cp")
    if seen_dp > dp or seen_pp > pp:
        raise ImportInputError(f"the trace has dp_rank up to {seen_dp - 1} and stage up to {seen_pp - 1}, more than "
                               f"dp={dp}, pp={pp}; pass the job's sizes with --dp/--pp or --meta JOB.yaml")
    return layout


def _check_workers(con: duckdb.DuckDBPyConnection, source: str, layout: Layout, writer: RunWriter) -> None:
    """Each rank must sit at its (dp_rank, stage) in Megatron order; missing workers are reported."""
    rows = con.execute(f"SELECT DISTINCT rank, dp_rank, stage FROM ({source}) ORDER BY rank").fetchall()
    hint = " (context/sequence parallelism? pass --cp or --meta JOB.yaml)" if layout.cp == 1 else ""
    lowest, highest = int(rows[0][0]), int(rows[-1][0])
    if lowest < 0 or highest >= layout.world:
        bad = lowest if lowest < 0 else highest
        raise ImportInputError(f"rank {bad} is outside the world of {layout.world} ranks "
                               f"({sizes_text(layout)}){hint if bad >= 0 else ''}; pass the job's sizes")
    for rank, dp_rank, stage in rows:
        pp_c, dp_c, _ = layout.coords(int(rank))
        if (pp_c, dp_c) != (int(stage), int(dp_rank)):
            raise ImportInputError(f"rank {rank} is at dp_rank={dp_rank}, stage={stage} in the trace, but at "
                                   f"dp={dp_c}, stage={pp_c} in Megatron rank order for {sizes_text(layout)}"
                                   f"{hint}; pass the job's real --dp/--tp/--pp/--cp")
    present = {(int(d), int(s)) for _, d, s in rows}
    missing = [(d, s) for s in range(layout.pp) for d in range(layout.dp) if (d, s) not in present]
    if missing:
        shown = ", ".join(f"dp={d}/stage={s}" for d, s in missing[:8])
        writer.warn(f"no rows for {len(missing)} worker(s) ({shown}{', ...' if len(missing) > 8 else ''}); "
                    "the others are imported")
