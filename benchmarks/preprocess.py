"""Preprocessing throughput: fit + transform of raw Criteo-format text into model-ready arrays.

Generates an N-row headerless Criteo TSV (label, I1-I13, C1-C26; the built-in synthetic
distribution), then times ``sampan.data.store.build_store`` with the Criteo preset — read,
validate, split, fit vocabularies and statistics on train, transform and write every split
— at N/4 and N rows, each in its own process so peak RSS is its own. When ``fuxictr`` is
importable it runs FuxiCTR's ``FeatureProcessor`` on the same file in the same run and
prints the ratio.

Usage::

    python benchmarks/preprocess.py                 # N = 5,000,000 (about 3 minutes)
    python benchmarks/preprocess.py --rows 1000000 --readme docs/explanations/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
COLS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


def generate(rows: int, path: Path) -> None:
    """Write ``rows`` Criteo-format lines (integers for I*, 8-hex tokens for C*)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    from sampan.config import SyntheticConfig
    from sampan.data.synthetic import iter_synthetic

    with open(path, "wb") as f:
        for t in iter_synthetic(SyntheticConfig(rows=rows, seed=7)):
            t = pa.table({c: (pc.cast(t[c], pa.int64()) if c[0] in "Il" else t[c])
                          for c in COLS})
            buf = pa.BufferOutputStream()
            pacsv.write_csv(t, buf, pacsv.WriteOptions(include_header=False, delimiter="\t",
                                                       quoting_style="none"))
            f.write(buf.getvalue().to_pybytes())


def run_sampan(path: Path, out: Path) -> dict:
    from sampan.config import load_config
    from sampan.data.store import build_store

    cfg = load_config(raw={"preset": "criteo", "data": {"train": str(path)}})
    t0 = time.perf_counter()
    store = build_store(cfg, out, echo=lambda *_: None)
    dt = time.perf_counter() - t0
    rows = store.manifest["rejects"]["read"]
    return {"rows": rows, "seconds": dt, "rows_per_s": rows / dt}


def run_fuxictr(path: Path, out: Path) -> dict:
    """FuxiCTR 2.x's ``build_dataset`` (read, fit, transform to Parquet) on the same rows,
    given as the CSV-with-header it expects; numeric I* standardised, categorical C*."""
    import logging

    from fuxictr.preprocess import FeatureProcessor, build_dataset

    logging.disable(logging.WARNING)
    feature_cols = [{"name": [f"I{i}" for i in range(1, 14)], "active": True,
                     "dtype": "float", "type": "numeric", "fill_na": 0,
                     "normalizer": "StandardScaler"},
                    {"name": [f"C{i}" for i in range(1, 27)], "active": True, "dtype": "str",
                     "type": "categorical"}]
    t0 = time.perf_counter()
    fp = FeatureProcessor(feature_cols=feature_cols,
                          label_col={"name": "label", "dtype": "float"},
                          dataset_id="bench", data_root=str(out))
    build_dataset(fp, train_data=str(path), data_format="csv", min_categr_count=2)
    dt = time.perf_counter() - t0
    rows = sum(1 for _ in open(path)) - 1
    return {"rows": rows, "seconds": dt, "rows_per_s": rows / dt}


def to_csv_with_header(tsv: Path) -> Path:
    """The same rows as a comma-separated file with a header (FuxiCTR's input)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    out = tsv.with_suffix(".csv")
    if not out.exists():
        t = pacsv.read_csv(tsv, read_options=pacsv.ReadOptions(column_names=COLS),
                           parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(
                               column_types={c: pa.string() for c in COLS}))
        pacsv.write_csv(t, out)
    return out


def worker(args: argparse.Namespace) -> None:
    fn = run_sampan if args.worker == "sampan" else run_fuxictr
    with tempfile.TemporaryDirectory() as out:
        r = fn(Path(args.file), Path(out) / "data")
    from benchmarks.accuracy import peak_rss_mb

    r["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(r), flush=True)


def spawn(which: str, path: Path) -> dict | None:
    p = subprocess.run([sys.executable, __file__, "--worker", which, "--file", str(path)],
                       capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"{which} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
    return None


def markdown(report: dict) -> str:
    lines = [f"Fit + transform of headerless Criteo TSV ({report['machine']['cores']} cores, "
             "one process each):", "",
             "| tool | rows | seconds | rows/s | peak RSS |", "|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['tool']} | {r['rows']:,} | {r['seconds']:.1f} | "
                     f"{r['rows_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} MB |")
    if report.get("rss_growth") is not None:
        lines.append("")
        lines.append(f"Peak RSS at 4x the rows: x{report['rss_growth']:.2f}.")
    if report.get("vs_fuxictr"):
        lines.append(f"Sampan vs FuxiCTR (rows/s, same file): {report['vs_fuxictr']:.1f}x.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "sampan-bench"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "preprocess.json"))
    ap.add_argument("--readme", default=None)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--file", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    runs = []
    sizes = [args.rows // 4, args.rows]
    for n in sizes:
        path = cache / f"criteo_{n}.tsv"
        if not path.exists():
            print(f"generating {n:,} rows -> {path}", flush=True)
            generate(n, path)
        r = spawn("sampan", path)
        if r:
            runs.append({"tool": "sampan", **r})
            print(f"sampan  {r['rows']:>10,} rows {r['seconds']:6.1f} s "
                  f"{r['rows_per_s']:>10,.0f} rows/s  peak RSS {r['peak_rss_mb']:,.0f} MB",
                  flush=True)
    fux = None
    try:
        import fuxictr  # noqa: F401
    except ImportError:
        print("fuxictr is not importable: no FuxiCTR comparison (pip install fuxictr)")
    else:
        fux = spawn("fuxictr", to_csv_with_header(cache / f"criteo_{sizes[0]}.tsv"))
        if fux:
            runs.append({"tool": "fuxictr", **fux})
            print(f"fuxictr {fux['rows']:>10,} rows {fux['seconds']:6.1f} s "
                  f"{fux['rows_per_s']:>10,.0f} rows/s  peak RSS {fux['peak_rss_mb']:,.0f} MB")
    s = [r for r in runs if r["tool"] == "sampan"]
    report = {"benchmark": "preprocess", "rows": args.rows, "runs": runs,
              "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
              "rss_growth": s[1]["peak_rss_mb"] / s[0]["peak_rss_mb"] if len(s) == 2 else None,
              "vs_fuxictr": s[0]["rows_per_s"] / fux["rows_per_s"] if fux and s else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(markdown(report))
    if args.readme:
        from _readme import update_block

        update_block(Path(args.readme), "preprocess", markdown(report))


if __name__ == "__main__":
    main()
