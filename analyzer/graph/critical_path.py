"""The cross-rank critical path of a step, by last-arrival backtracking on the step graph.

Start from the event that ends last. At a receive that waited for its sender, jump to the send (and
on to the compute that produced it), at a blocking send that waited for its receiver, to the receive;
at a collective, jump to the member that arrived last; at a forward/backward of a pipeline trace
without p2p rows whose input ended after its rank's previous op, to the span it depended on
(StepGraph.dep_of: on the sampled 64-GPU trace of tests/test_trace_back.py, p2p rows dropped, the path of
step 100 crosses the stages by 6 such hops, 0.49 s of it on the 2.35x straggler; without the edges it
stayed in one rank's program order);
otherwise step back in program order. The chain is what bounded the step: shorten any of it and
the step gets shorter.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.analyzer.graph.step_graph import StepGraph


def critical_path(g: StepGraph) -> pd.DataFrame:
    ev = g.events
    cols = ["event_id", "rank", "step", "name", "kind", "microbatch", "chunk", "issue_ns", "start_ns", "end_ns"]
    if ev.empty:
        return pd.DataFrame(columns=cols + ["duration_s", "via"])
    issue, end = ev.issue_ns.to_numpy(), ev.end_ns.to_numpy()
    dep_of = g.dep_of if g.dep_of is not None else np.full(len(ev), -1, dtype=np.int64)
    recv_of = np.full(len(ev), -1, dtype=np.int64)  # a send that waited for its receiver (synchronous
    recv_of[g.send_of[g.send_of >= 0]] = np.flatnonzero(g.send_of >= 0)  # sends): jump to the recv
    at = int(np.argmax(ev.end_ns.to_numpy()))
    path, via = [at], ["end"]
    seen = {at}
    while True:
        send, last = g.send_of[at], g.last_arrival[at]
        if send >= 0 and issue[send] > issue[at]:
            nxt, how = int(send), "p2p"
        elif g.blocking[at] and recv_of[at] >= 0 and issue[recv_of[at]] > issue[at]:
            nxt, how = int(recv_of[at]), "p2p"
        elif last >= 0 and last != at and issue[last] > issue[at]:
            nxt, how = int(last), "collective"
        elif dep_of[at] >= 0 and (g.prev[at] < 0 or end[dep_of[at]] > end[g.prev[at]]):
            nxt, how = int(dep_of[at]), "pipeline"  # its input came last (a trace without p2p rows)
        else:
            nxt, how = int(g.prev[at]), "program_order"
        if nxt < 0 or nxt in seen:
            break
        seen.add(nxt)
        via[-1] = how          # how the later event depended on this one
        path.append(nxt)
        via.append("start")
        at = nxt
    out = ev.iloc[path[::-1]][cols].reset_index(drop=True)
    out["duration_s"] = (out.end_ns - out.start_ns) / 1e9
    out["via"] = via[::-1]
    return out

