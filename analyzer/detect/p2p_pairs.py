"""The flap detector's two p2p series (flaps.py) from one pairing of each link's two ends in numpy.

p2p_links.sql pairs the rows of _p2p_peer_step (rank, peer, step) toward each other with a FULL JOIN:
at 12,288 ranks x 1,000 steps 10.75 M rows to 10.75 M, whose hash table and result spilled under the
detectors' DuckDB memory limit (~9 of the detector's 18 CPU s with p2p_series and p2p_stalls). The
links are few (~11 k pipeline neighbour pairs) and each has a row on nearly every step, so here every
link gets one cell per step: each row is scattered into its link's cell by side (the lower rank's end,
the higher's, or a rank's transfers to itself), the two ends meet in the cell, and each series' baseline
is a median over the rows of a stage pair's links, a column at a time. The rows are p2p_series' and
p2p_stalls' (tests/test_flaps_pairs.py); a layout that would not be dense (sampled steps), duplicate
rows, or no rows give None, and the detector takes the SQL instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from megascope.analyzer.data.store import Store, load_sql

LOWER, UPPER, SELF = 0, 1, 2
"""p2p_peer_cells.side: the row is the lower rank's end of its link (rank < peer), the higher's, or a
rank's transfers to itself."""
SPARSE = 2
"""Cells per row beyond which the layout is not dense enough (a sampled trace's steps N apart) and the
SQL pairs the ends instead."""


@dataclass
class LinkPairs:
    """p2p_link_pairs as links x steps matrices: per link (a <= b) its ends and stages, per cell (link,
    step lo + column) the two directions' floors, the stall and whether the pairing has a row there."""

    a: np.ndarray
    """Per link: its lower rank (int32)."""
    b: np.ndarray
    """Per link: its higher rank (a == b: a rank's transfers to itself)."""
    a_pp: np.ndarray
    """Per link: the stage of a (float: NaN for a rank the topology gives none)."""
    b_pp: np.ndarray
    """Per link: the stage of b."""
    lo: int
    """The step of column 0."""
    floors: np.ndarray | None
    """Directed links x steps: row i < L the floor a -> b of link i (ab_floor_s), row L + i its b -> a
    (ba_floor_s); NaN: NULL, and on links whose ends have no stage (p2p_series' JOIN on the stages
    leaves them out). None once taken (take_floors)."""
    stall: np.ndarray
    """Links x steps: stall_s (NaN: NULL, or no row)."""
    present: np.ndarray
    """Links x steps: the pairing has a row there (either end has one)."""

    def take_floors(self) -> np.ndarray:
        """The floors matrix, released from here (its ~170 MB at 12,288 x 1,000 go with the taker)."""
        floors, self.floors = self.floors, None
        assert floors is not None, "the floors are taken once"
        return floors

    def directed(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row of the floors matrix: its src and dst rank (int32)."""
        return np.concatenate([self.a, self.b]), np.concatenate([self.b, self.a])

    def baselines(self, floors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """p2p_series' baseline_s as (base, group): base[group[row], column] is the median floor of the
        directed links of row's stage pair at that step (the links staged (x, y) a -> b and those
        staged (y, x) b -> a); rows without a stage pair get the last group, all NaN."""
        src_pp = np.concatenate([self.a_pp, self.b_pp])
        dst_pp = np.concatenate([self.b_pp, self.a_pp])
        return _group_medians(floors, src_pp * (1 << 20) + dst_pp)

    def stall_baselines(self) -> tuple[np.ndarray, np.ndarray]:
        """p2p_stalls' baseline_s as (base, group) per link, as baselines(): the median stall of the links
        of its stage pair (pp of a, pp of b) at the step; links p2p_stalls leaves out (a stage missing,
        a rank's transfers to itself) get the last group, all NaN."""
        pair = self.a_pp * (1 << 20) + self.b_pp
        pair[self.a == self.b] = np.nan
        return _group_medians(self.stall, pair)

    def series(self) -> dict[str, np.ndarray]:
        """p2p_series' columns src, dst, step, floor_s, baseline_s as arrays: its rows (directed
        link-steps with a floor), which the detector reads as the matrices (flaps.py); takes the floors."""
        floors = self.take_floors()
        base, group = self.baselines(floors)
        src, dst = self.directed()
        row, col = np.nonzero(~np.isnan(floors))
        return {"src": src[row], "dst": dst[row], "step": col + np.int64(self.lo), "floor_s": floors[row, col],
                "baseline_s": base[group[row], col]}

    def stalls(self) -> dict[str, np.ndarray]:
        """p2p_stalls' columns a, b, step, stall_s, baseline_s as arrays: its rows (link-steps with a row,
        a < b), which the detector reads as the matrices (flaps.py)."""
        base, group = self.stall_baselines()
        link, col = np.nonzero(self.present & (group < len(base) - 1)[:, None])
        return {"a": self.a[link], "b": self.b[link], "step": col + np.int64(self.lo),
                "stall_s": self.stall[link, col], "baseline_s": base[group[link], col]}


def read_pairs(store: Store, warm: list[int]) -> LinkPairs | None:
    """The pairing of _p2p_peer_step's rows outside the `warm` steps; None when its layout would not be
    dense, a (rank, peer, step) has two rows, or there are none: then p2p_links.sql pairs them."""
    pairs = store.query(load_sql("p2p_peer_links"), {"warm": warm})
    if pairs.empty:
        return None
    known = set(store.topology["rank"].astype(int))
    pairs = pairs[pairs["rank"].isin(known) & pairs.peer.isin(known)]   # p2p_links joins the topology
    if pairs.empty:
        return None
    ids, links = _link_ids(pairs, store.topology)
    lo = int(pairs.lo.min())
    span = int(pairs.hi.max()) - lo + 1
    if len(links) * span > SPARSE * int(pairs.n.sum()):
        return None
    store.con.register("_p2p_link_ids", ids)
    try:
        cells = store.run_with_retry(lambda: _scatter(store, warm, lo, span, len(links)))
    finally:
        store.con.unregister("_p2p_link_ids")
    if cells is None:   # a (rank, peer, step) with two rows
        return None
    return cells.pairs(links, lo, span)


def column_medians(m: np.ndarray) -> np.ndarray:
    """Per column of `m`, DuckDB's median of its non-NaN values (the mean of the two middle ones for an
    even count, NaN for none): each baseline of p2p_series / p2p_stalls."""
    k = len(m)
    if k == 0:
        return np.full(m.shape[1], np.nan)
    nan = np.isnan(m)
    if not nan.any():
        # every column full: the two middle values by one partition (no sort)
        part = np.partition(m, [(k - 1) // 2, k // 2], axis=0)
        return (part[(k - 1) // 2] + part[k // 2]) / 2
    n = k - nan.sum(axis=0)
    s = np.sort(m, axis=0)   # NaN last
    lo = np.take_along_axis(s, np.maximum((n - 1) // 2, 0)[None], axis=0)[0]
    hi = np.take_along_axis(s, np.minimum(n // 2, k - 1)[None], axis=0)[0]
    out = (lo + hi) / 2
    out[n == 0] = np.nan
    return out


def _group_medians(m: np.ndarray, pair: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(base, group): per row of `m` its group (rows of one stage pair code, NaN: none, the last group)
    and per group the column medians of its rows."""
    codes = np.unique(pair[~np.isnan(pair)])
    group = np.searchsorted(codes, pair)   # NaN sorts last: len(codes)
    base = np.full((len(codes) + 1, m.shape[1]), np.nan)
    for g in range(len(codes)):
        base[g] = column_medians(m[group == g])
    return base, group


def _link_ids(pairs: pd.DataFrame, topology: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per directed pair (rank, peer) its link id and side (_p2p_link_ids), and per link its ends a <= b
    and their stages."""
    rank, peer = pairs["rank"].to_numpy(np.int64), pairs.peer.to_numpy(np.int64)
    a, b = np.minimum(rank, peer), np.maximum(rank, peer)
    link, codes = pd.factorize(a * (int(b.max(initial=0)) + 1) + b)
    side = np.where(rank < peer, LOWER, np.where(rank > peer, UPPER, SELF)).astype(np.int8)
    ids = pd.DataFrame({"rank": rank.astype(np.int32), "peer": peer.astype(np.int32),
                        "link": link.astype(np.int32), "side": side})
    ends = pd.DataFrame({"link": link, "a": a, "b": b}).drop_duplicates("link").sort_values("link")
    pp = topology.set_index("rank")["pp"]
    links = pd.DataFrame({"a": ends.a.to_numpy(np.int32), "b": ends.b.to_numpy(np.int32),
                          "a_pp": pp.reindex(ends.a).to_numpy(dtype=float),
                          "b_pp": pp.reindex(ends.b).to_numpy(dtype=float)})
    assert len(links) == len(codes)
    return ids, links


class _Cells:
    """Each link end's row, placed as the rows stream in: per cell and side (LOWER, UPPER) its send,
    receive and gap (NaN: none), and whether it had a row; a rank's rows to itself kept aside (rare). One
    scatter per column and batch, the two ends met at the end in whole-array operations (a least() per
    row as it came, gathering and scattering each cell's values again, took ~3x the CPU)."""

    def __init__(self, n: int) -> None:
        # not filled with NaN here: a dense layout writes nearly every cell, and pairs() fills the rest
        self.send, self.recv, self.gap = (np.empty((2, n)) for _ in range(3))
        self.seen = np.zeros((2, n), np.bool_)
        self.n = n
        self.rows = 0
        self.own: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        """(cell, send, recv) of the SELF rows."""

    def add(self, side: np.ndarray, cell: np.ndarray, send: np.ndarray, recv: np.ndarray, gap: np.ndarray) -> None:
        """One batch of p2p_peer_cells."""
        if len(side) and side.max() == SELF:
            own = side == SELF
            self.own.append((cell[own], send[own], recv[own]))
            side, cell, send, recv, gap = (x[~own] for x in (side, cell, send, recv, gap))
        self.rows += len(cell)
        at = side.astype(np.int64)
        at *= self.n
        at += cell
        for values, x in ((self.send, send), (self.recv, recv), (self.gap, gap)):
            values.reshape(-1)[at] = x
        self.seen.reshape(-1)[at] = True

    def unique(self) -> bool:
        """Whether every row had a (cell, side) of its own."""
        own = np.concatenate([c for c, _, _ in self.own]) if self.own else np.empty(0, np.int64)
        return int(np.count_nonzero(self.seen)) == self.rows and len(np.unique(own)) == len(own)

    def pairs(self, links: pd.DataFrame, lo: int, span: int) -> LinkPairs:
        """The matrices: a floor where one end sent and the other recorded the receive (least() of the
        two, as p2p_links: NaN, a NULL, is skipped), the stall of both ends (0 for one end alone). The
        floors are written over the sends, the stall over the receives (no new cells arrays)."""
        send, recv, gap, seen = self.send, self.recv, self.gap, self.seen
        unseen = ~seen
        for values in (send, recv, gap):
            np.copyto(values, np.nan, where=unseen)   # a side without a row: NULL
        del unseen
        both = np.isnan(send[0]) | np.isnan(recv[1])   # a -> b: no floor
        np.fmin(send[0], recv[1], out=send[0])
        send[0, both] = np.nan
        np.logical_or(np.isnan(send[1]), np.isnan(recv[0]), out=both)   # b -> a
        np.fmin(send[1], recv[0], out=send[1])
        send[1, both] = np.nan
        stall = recv[0]
        np.fmin(gap[0], gap[1], out=stall)
        np.logical_xor(seen[0], seen[1], out=both)
        stall[both] = 0.0
        present = seen[0] | seen[1]
        del self.gap, self.recv
        for cell, s, r in self.own:   # p2p_links takes a rank's row to itself only when it sent
            sent = ~np.isnan(s)
            cell, s, r = cell[sent], s[sent], r[sent]
            send[0, cell] = np.where(np.isnan(r), np.nan, np.fmin(s, r))
            present[cell] = True
        stall[~present] = np.nan
        shape = (len(links), span)
        staged = ~(np.isnan(links.a_pp.to_numpy()) | np.isnan(links.b_pp.to_numpy()))
        floors = send.reshape(2, len(links), span)
        floors[:, ~staged] = np.nan   # p2p_series joins the stages
        return LinkPairs(links.a.to_numpy(), links.b.to_numpy(), links.a_pp.to_numpy(), links.b_pp.to_numpy(),
                         lo, floors.reshape(2 * len(links), span), stall.reshape(shape), present.reshape(shape))


def _scatter(store: Store, warm: list[int], lo: int, span: int, n_links: int) -> _Cells | None:
    """p2p_peer_cells streamed into the links x steps cells; None when a (rank, peer, step) has two rows
    (a cell would then have two rows of one side)."""
    cells = _Cells(n_links * span)
    reader = store.con.sql(load_sql("p2p_peer_cells"), params={"warm": warm, "lo": lo, "span": span}
                           ).to_arrow_reader(1 << 20)
    for batch in reader:
        col = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in batch.schema.names}
        cells.add(col["side"], col["cell"], col["send_s"], col["recv_s"], col["gap_s"])
        del col
    return cells if cells.unique() else None
