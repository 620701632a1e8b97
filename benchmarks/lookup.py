"""Vocabulary / join-key lookup: ``ValueIndex`` against ``pyarrow.compute.index_in``.

Both map query strings to their position in a fixed set of distinct strings: the
transform of a categorical column (a chunk of 65,536 values against its vocabulary) and a
feature-store join at serving time (100 keys against the table's keys). ``index_in``
rebuilds a hash table of the whole set per call; ``ValueIndex`` hashes the set once and
searches it. Prints milliseconds per call for each and the ratio, for set sizes up to
``--max-size``; results agree value for value (checked).

Usage::

    python benchmarks/lookup.py                 # sets of 10k .. 2M, about a minute
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def per_call(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm: ValueIndex builds its index on first use
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1000


def main() -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from sampan.data.transforms import ValueIndex

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-size", type=int, default=2_000_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| set size | query | index_in ms | ValueIndex ms | ratio | index build ms |")
    print("|---|---|---|---|---|---|")
    for n in [s for s in (10_000, 100_000, 500_000, 2_000_000) if s <= args.max_size]:
        values = pa.array([f"{i:08x}" for i in rng.permutation(n)])  # Criteo-style tokens
        for q in (65_536, 100):
            query = pa.array([f"{i:08x}" for i in rng.integers(0, int(n * 1.2), q)])
            t0 = time.perf_counter()
            index = ValueIndex(values)
            index.prepare(q)
            build = (time.perf_counter() - t0) * 1000
            want = pc.fill_null(pc.index_in(query, value_set=values), -1).to_numpy()
            assert (index.positions(query) == want).all()
            repeat = 5 if q > 1000 else 50
            a = per_call(lambda: pc.index_in(query, value_set=values), repeat)  # noqa: B023
            b = per_call(lambda: index.positions(query), repeat)  # noqa: B023
            print(f"| {n:,} | {q:,} | {a:.2f} | {b:.2f} | x{a / b:.1f} | {build:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
