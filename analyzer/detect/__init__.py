"""The detectors: peer statistics and episodes, then stragglers, late launches, link flaps and slow
links, stage and workload imbalance, hangs; and what is done to their findings afterwards (merging
across dp replicas, naming the culprit a link finding is explained by)."""
