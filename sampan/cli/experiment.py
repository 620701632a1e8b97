"""``sampan experiment``: analyse an A/B test's feedback log, or estimate a candidate model's
click rate on logged traffic before testing it."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from sampan.cli.base import app, console
from sampan.errors import ConfigError

experiment_app = typer.Typer(help="A/B tests: the report of a feedback log, and off-policy "
                                  "evaluation of a candidate on logged traffic.",
                             no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")


def parse_shares(items: list[str] | None) -> dict[str, float] | None:
    """``["control=90", "candidate=10"]`` -> shares of traffic that add up to 1."""
    if not items:
        return None
    out: dict[str, float] = {}
    for item in items:
        name, eq, w = item.partition("=")
        if not eq or not name or not re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", w.strip()):
            raise ConfigError(f"--weight {item!r}: expected ARM=WEIGHT, e.g. control=90 (a "
                              "weight of 0 or more)")
        out[name] = float(w)
    total = sum(out.values())
    if total <= 0:
        raise ConfigError(f"--weight: the weights {out} add up to 0")
    return {k: v / total for k, v in out.items()}


def _pct(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1%}"


@experiment_app.command()
def report(
    log_dir: Annotated[Path, typer.Argument(help="The feedback log (time-partitioned "
                                            "Parquet that `sampan serve` writes).")],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Folder for report.json and ctr.png [LOG_DIR/report].")] = None,
    weight: Annotated[list[str] | None, typer.Option(
        "--weight", "-w", metavar="ARM=WEIGHT", help="Configured share of an arm, for the "
        "sample-ratio check; repeat per arm [LOG_DIR/experiment.json's, else equal].")] = None,
    control: Annotated[str | None, typer.Option(
        help="The arm others are compared with [control, else the first].")] = None,
    pre: Annotated[Path | None, typer.Option(
        help="A feedback log of the same users before the test: CUPED-adjusted CTR and "
             "lift.")] = None,
) -> None:
    """Per arm: units (users), requests, impressions, clicks, CTR with its 95 % interval
    (delta method: the user is the unit), the lift over control with its interval and
    p-value, GAUC and MRR of the served scores; the sample-ratio-mismatch check of units
    against the configured weights (flagged at p < 0.001). Forced (QA) requests are left
    out.

    Examples:

      sampan experiment report feedback/ --weight control=90 --weight candidate=10

      sampan experiment report feedback/ --pre feedback-last-week/
    """
    from sampan.experiment.report import report as make_report

    out = out or log_dir / "report"
    r = make_report(log_dir, out, parse_shares(weight), control, pre)
    traffic = Table(title=f"{log_dir}: traffic and ranking per arm")
    for col in ("arm", "units", "requests", "impressions", "clicks", "GAUC", "MRR"):
        traffic.add_column(col, justify="left" if col == "arm" else "right")
    ctr = Table(title=f"CTR per arm (unit: the user), lift against {r['control']}")
    for col in ("arm", "CTR", "95 % CI", "lift", "95 % CI", "p"):
        ctr.add_column(col, justify="left" if col == "arm" else "right")
    for a, s in r["arms"].items():
        traffic.add_row(a, f"{s['units']:,}", f"{s['requests']:,}", f"{s['impressions']:,}",
                        f"{s['clicks']:,}", f"{s['gauc']:.4f}", f"{s['mrr']:.4f}")
        lo, hi = s["ctr_ci95"]
        lf = s.get("lift")
        ctr.add_row(a, f"{s['ctr']:.4f}", f"[{lo:.4f}, {hi:.4f}]",
                    _pct(lf["lift"]) if lf else "-",
                    f"[{_pct(lf['ci95'][0])}, {_pct(lf['ci95'][1])}]" if lf else "-",
                    f"{lf['p_value']:.3g}" if lf else "-")
    console.print(traffic)
    console.print(ctr)
    for a, s in r["arms"].items():
        if "cuped" in s and "lift" in s["cuped"]:
            c = s["cuped"]
            console.print(f"CUPED {a}: CTR {c['ctr']:.4f}, lift {_pct(c['lift']['lift'])} "
                          f"[{_pct(c['lift']['ci95'][0])}, {_pct(c['lift']['ci95'][1])}], "
                          f"p {c['lift']['p_value']:.3g} (theta {c['theta']:.3f})")
    srm = r["srm"]
    flag = "[bold red]SAMPLE RATIO MISMATCH[/]: the arms' traffic does not match their " \
        "weights; the comparison is not trustworthy" if srm["flagged"] else "ok"
    if len(srm["shares"]) < 2:
        console.print("sample ratio: one arm, nothing to check")
    else:
        console.print(f"sample ratio: chi2 {srm['chi2']:.2f}, p {srm['p_value']:.3g} against "
                      + ", ".join(f"{a} {s:.1%}" for a, s in srm["shares"].items())
                      + ("" if srm["shares_given"] else " (equal: no weights given)")
                      + f": {flag}")
    if r["forced_rows"]:
        console.print(f"{r['forced_rows']:,} forced (QA) rows left out")
    console.print(f"wrote {out / 'report.json'} and {out / 'ctr.png'}")


@experiment_app.command()
def ope(
    log_dir: Annotated[Path, typer.Argument(help="A feedback log served with exploration "
                                            "on (its rows carry propensities).")],
    candidate: Annotated[Path, typer.Option(help="The candidate's bundle (sampan "
                                            "export).")],
    policy: Annotated[str, typer.Option(help="How the candidate would serve: greedy (its top "
                                        "score first) or softmax.")] = "greedy",
    temperature: Annotated[float, typer.Option(min=1e-6, help="softmax temperature")] = 1.0,
    reward_model: Annotated[str, typer.Option(
        help="DR's reward model: own (the candidate's click probability) or calibrated "
             "(Platt-scaled on the logged clicks, cross-fitted).")] = "own",
    resamples: Annotated[int, typer.Option(min=50, help="bootstrap resamples")] = 1000,
    variant: Annotated[str | None, typer.Option(
        help="Only this arm's traffic [all unforced rows].")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="JSON file to write.")] = None,
) -> None:
    """Estimate the candidate's click rate on logged traffic, before an A/B test: IPS, SNIPS
    and doubly robust, each with a 95 % bootstrap interval, beside the logged policy's own
    click rate. The candidate scores every logged item from the features the served model
    saw.

    Example:

      sampan experiment ope feedback/ --candidate bundles/deepfm-v2
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401  (pa.compute)

    from sampan.experiment import ope as ope_mod
    from sampan.experiment.log import column, feature_columns, read_log
    from sampan.experiment.report import to_json
    from sampan.serving import Predictor

    table = read_log(log_dir, unshown=True)
    keep = ~column(table, "forced").astype(bool)
    if variant is not None:
        keep &= column(table, "variant").astype(str) == variant
    table = table.filter(pa.array(keep))
    if "propensity" not in table.column_names:
        raise ConfigError(f"{log_dir} has no propensity column: serve with explore: on to "
                          "evaluate other policies on its traffic")
    # only explored rankings have propensities (not /v1/predict, not traffic before explore)
    explored = pa.compute.is_valid(table.column("propensity")).to_numpy(zero_copy_only=False)
    left_out = table.num_rows - int(explored.sum())
    table = table.filter(pa.array(explored))
    if table.num_rows == 0:
        raise ConfigError(f"{log_dir} holds no explored traffic (every propensity is null): "
                          "serve with explore: on to evaluate other policies on it")
    predictor = Predictor(candidate)
    known = set(predictor.columns)  # the candidate's raw inputs among the logged features
    inputs = [c for c in feature_columns(table) if c in known]
    # each arm logged the features its own model read: an arm whose rows lack some of the
    # candidate's inputs (all null) cannot be scored by it, and is left out
    arms = column(table, "variant").astype(str)
    lacking = {}
    for arm in sorted(set(arms)):
        rows = table.filter(pa.array(arms == arm))
        gone = [c for c in inputs if rows.column(c).null_count == rows.num_rows]
        if gone:
            lacking[arm] = gone
    if lacking:
        table = table.filter(pa.array(~np.isin(arms, list(lacking))))
        if table.num_rows == 0:
            raise ConfigError(f"the logged rows lack inputs of {candidate}: " + "; ".join(
                f"arm {a}: {g}" for a, g in lacking.items()))
    records = table.select(inputs).to_pylist()
    scores = predictor.predict(records)[:, 0]
    log = ope_mod.Logged.of(column(table, "request_id").astype(str),
                            column(table, "position"),
                            np.asarray(column(table, "propensity"), dtype=np.float64),
                            column(table, "label"))
    r = ope_mod.evaluate(log, scores, policy, temperature, reward_model, resamples)
    r["variants"] = sorted(set(column(table, "variant").astype(str)))
    r["left_out"] = {a: {"missing_inputs": g} for a, g in lacking.items()}
    t = Table(title=f"candidate {candidate} on {r['requests']:,} logged requests "
              f"({'+'.join(r['variants'])})")
    for col in ("estimator", "click rate", "95 % interval"):
        t.add_column(col)
    t.add_row("logged policy", f"{r['logged_ctr']:.4f}", "")
    for k, v in r["estimates"].items():
        t.add_row(k.upper(), f"{v['estimate']:.4f}", f"[{v['low']:.4f}, {v['high']:.4f}]")
    console.print(t)
    console.print(f"effective sample size {r['effective_sample_size']:,.0f} of "
                  f"{r['requests']:,} requests; largest weight {r['max_weight']:.1f}"
                  + (f"; {left_out:,} logged rows without a propensity left out"
                     if left_out else ""))
    for a, g in lacking.items():
        console.print(f"arm {a} left out: its rows lack the candidate's inputs {g} (its "
                      "model did not read them)")
    if out:
        out.write_text(to_json(r))
        console.print(f"wrote {out}")
