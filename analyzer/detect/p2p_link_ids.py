"""The links of a p2p series by dense ids, for the flap detector (flaps.py): per row of the series its
directed and unordered link, per unordered link its ends and stages, the steps each link was observed,
and the boundary-peak rule that keeps only the degraded rows above their boundary's typical worst step.
Integer codes hashed once, not groupings of the series' columns: at 12,288 ranks x 1,000 steps the
series is 21.5 M link-steps, and each grouping by two or four columns took seconds."""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.analyzer.detect.peer_stats import leave_one_out_median


class LinkIds:
    """The links of a p2p series (one row per link-step, ends in either order) by dense ids: per row its
    directed link (src -> dst), per directed link its unordered one, per unordered link its ends (a < b)
    and stages (lo <= hi). One int64 code per row hashed once: grouping 21.5 M link-steps by two or four
    columns took seconds, and each grouping repeated it."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, topology: pd.DataFrame) -> None:
        width = int(max(src.max(), dst.max())) + 1 if len(src) else 1
        code = src.astype(np.int64)   # src * width + dst, in place (each temporary: 172 MB at 21.5 M rows)
        code *= width
        code += dst
        directed, codes = pd.factorize(code)
        del code
        self.directed = directed.astype(np.int32)
        """Per row: its directed link."""
        codes = np.asarray(codes, dtype=np.int64)
        s, d = codes // width, codes % width
        unordered, ucodes = pd.factorize(np.minimum(s, d) * width + np.maximum(s, d))
        self.unordered_of = unordered.astype(np.int32)
        """Per directed link: its unordered link."""
        self.links = link_frame(np.asarray(ucodes) // width, np.asarray(ucodes) % width, topology)
        """Per unordered link: lo, hi (its stages, NaN for a rank without one), a, b."""

    def unordered(self) -> np.ndarray:
        """Per row: its unordered link."""
        return self.unordered_of[self.directed]

    def observed_steps(self, step: np.ndarray) -> pd.Series:
        """Steps observed per unordered link (either direction), indexed (lo, hi, a, b) like a groupby of
        _link_steps (links without a stage left out)."""
        link = self.unordered()
        n_links = len(self.links)
        lo = int(step.min()) if len(step) else 0
        span = int(step.max()) - lo + 1 if len(step) else 1
        cell = link.astype(np.int64)   # link * span + step - lo, in place
        cell *= span
        cell += step
        cell -= lo
        if n_links * span <= max(4 * len(step), 1 << 24):
            # a (link, step) bitmap: each link-step marked once however many rows it has
            seen = np.zeros(n_links * span, dtype=bool)
            seen[cell] = True
            counts = seen.reshape(n_links, span).sum(axis=1)
        else:  # sparse steps: the first row of each (link, step) cell
            first = ~pd.Series(cell).duplicated().to_numpy()
            counts = np.bincount(link[first], minlength=n_links)
        return observed_counts(self.links, counts)


def observed_counts(links: pd.DataFrame, counts: np.ndarray) -> pd.Series:
    """Per unordered link (`links`: lo, hi, a, b) its observed steps (`counts`), indexed (lo, hi, a, b) in
    order; links without a stage or a step left out."""
    links = links.assign(n=counts).dropna(subset=["lo", "hi"])
    links = links[links.n > 0].sort_values(["lo", "hi", "a", "b"])
    return pd.Series(links.n.to_numpy(), index=pd.MultiIndex.from_frame(links[["lo", "hi", "a", "b"]]))


def link_frame(a: np.ndarray, b: np.ndarray, topology: pd.DataFrame) -> pd.DataFrame:
    """Per unordered link (ends a <= b) its stages lo <= hi (NaN for a rank without one), a, b (int64)."""
    pp = topology.set_index("rank")["pp"]
    a, b = a.astype(np.int64), b.astype(np.int64)
    pa, pb = pp.reindex(a).to_numpy(), pp.reindex(b).to_numpy()
    return pd.DataFrame({"lo": np.minimum(pa, pb), "hi": np.maximum(pa, pb), "a": a, "b": b})


def above_boundary_peaks(links: LinkIds, lr: np.ndarray, bad: pd.DataFrame) -> pd.DataFrame:
    """The degraded p2p rows whose log ratio exceeds the worst step of the boundary's typical link:
    the median, over the OTHER links of the same pair of stages, of each link's largest log ratio in
    the run. On a clean boundary that peak is a few noise sigmas, below the z_flag threshold, and this
    changes nothing; on a boundary whose transfers all carry random peer waiting (+1.2-1.5 ms on 4 ms)
    it is the top of that scatter, which a link's own fault (+4 ms) still clears. `lr`: the log ratio
    of every row of the series `links` was built from."""
    if bad.empty:
        return bad
    finite = np.isfinite(lr)
    link = links.unordered()
    if not finite.all():
        link, lr = link[finite], lr[finite]
    top = np.full(len(links.links), -np.inf)
    np.maximum.at(top, link, lr)   # each link's largest finite log ratio (a groupby took ~1 s)
    return above_peaks(links.links, top, np.bincount(link, minlength=len(top)) > 0, bad)


def above_peaks(links: pd.DataFrame, top: np.ndarray, has: np.ndarray, bad: pd.DataFrame) -> pd.DataFrame:
    """above_boundary_peaks given per unordered link (`links`: lo, hi, a, b) its largest finite log
    ratio (`top`) and whether it has one (`has`)."""
    peak = links[has].assign(lr=top[has]).dropna(subset=["lo", "hi"])
    peak = peak.sort_values(["lo", "hi", "a", "b"]).reset_index(drop=True)
    peak["typical"] = leave_one_out_median(peak, ["lo", "hi"], "lr")
    typical = peak.set_index(["a", "b"]).typical
    pairs = pd.MultiIndex.from_arrays([bad[["src", "dst"]].min(axis=1), bad[["src", "dst"]].max(axis=1)])
    limit = typical.reindex(pairs).fillna(-np.inf).to_numpy()   # a link alone on its boundary: no peers
    return bad[bad.lr.to_numpy() > limit]
