"""The watcher's tracker keeps the network between two hosts as one live finding: a window holds one
episode of a link throttled every few seconds (a slow_link), the next window the next; live they are
one network_flap whose episode count grows, open between episodes, with its first episode's onset.
And an episode that ended well before the newest step of a flush is still news (benchmarks/
watch_network.py: the first of 13 episodes was announced 37 s late when it was judged stale)."""

from __future__ import annotations

from megascope.analyzer.findings import Finding
from megascope.analyzer.watch.tracker import Tracker


def link(first: int, last: int) -> Finding:
    """What the lost-time detector names for one episode between node0 and node1 (its evidence's form)."""
    return Finding("slow_link", [0, 1, 2, 3], ["node0", "node1"], (first, last), 4.2,
                   "The network between node0 and node1 slowed in 1 episode(s) while compute held.",
                   {"episodes": [[first, last]], "episode_count": 1, "source": "lost_time"})


def test_an_episode_judged_after_a_whole_flush_is_news():
    t = Tracker(end_after=4, hold=16, network_hold=128)
    changes = t.update([link(38, 41)], at_step=56, since=33)
    assert [c.event for c in changes] == ["start"]
    stale = Tracker(end_after=4, hold=16, network_hold=128)
    assert stale.update([link(38, 41)], at_step=56) == []  # judged as of step 56 alone: old news


def test_episodes_of_one_link_are_one_finding_that_counts_them():
    t = Tracker(end_after=4, hold=16, network_hold=128)
    events = []
    for at, window in [(57, [link(48, 52)]), (90, []), (150, [link(140, 145)]), (180, []), (230, [link(224, 229)]),
                       (231, [link(224, 230)])]:
        changes = t.update(window, at, at - 30)
        events += [(c.event, c.finding.kind, c.finding.evidence["episode_count"]) for c in changes]
    assert events == [("start", "slow_link", 1), ("update", "network_flap", 2), ("update", "network_flap", 3)]
    (f,) = t.open.values()
    assert f.steps == (48, 230) and f.evidence["episodes"] == [[48, 52], [140, 145], [224, 230]]
    assert "Live: 3 episode(s) since step 48" in f.summary


def test_the_flap_ends_only_after_its_hold_without_an_episode():
    t = Tracker(end_after=4, hold=16, network_hold=128)
    t.update([link(48, 52)], 57, 30)
    t.update([link(140, 145)], 150, 120)  # a gap of 88 steps: held at least 2 x 88 from now on
    assert t.update([], 145 + 170, 290) == []
    assert [c.event for c in t.update([], 145 + 177, 320)] == ["end"]


def test_a_flap_still_coming_at_the_end_of_the_run_is_open_at_end():
    t = Tracker(end_after=4, hold=16, network_hold=128)
    t.update([link(48, 52)], 57, 30)
    t.update([link(140, 145)], 150, 120)
    assert [c.event for c in t.close_at_end(230)] == ["open_at_end"]
