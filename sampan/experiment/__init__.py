"""A/B experiments on served traffic: the report of a feedback log (per-arm CTR with the
user as the unit, lift, sample-ratio mismatch, CUPED, GAUC / MRR) and off-policy estimates
of a candidate model's click rate on logged traffic (IPS, SNIPS, doubly robust).

Analysis reads the feedback log (:mod:`sampan.experiment.log`: time-partitioned Parquet,
the same files ``sampan stream``'s directory source reads), never serving's internals.
"""
