"""A study's ending: the defaults run it is compared with, the best config as YAML, and the
summary (``summary.json`` and the printed table).

The comparison is on the test split, which no trial was chosen on: the best trial's test
metrics with their bootstrap interval, and the paired bootstrap of its AUC against the run of
the config as written (``FOLDER/defaults``), both models scoring the same rows.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from sampan.config import apply_override, dump_config, load_config
from sampan.tune.space import as_overrides, trial_config
from sampan.tune.study import EPOCH_UNITS, TuneJob, _optuna, counts

DEFAULTS = "defaults"


def run_defaults(job: TuneJob, console: Console) -> Path:
    """Train the config as written (no tuned value), once: a killed one resumes."""
    from sampan.train.experiment import run_experiment

    run = job.folder / DEFAULTS
    if (run / "results.json").exists():
        return run
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "tune.log", "a") as log:
        run_experiment(trial_config(job.config, job.run_overrides, {}), run,
                       resume=(run / "config.yaml").exists(),
                       console=Console(file=log, width=110))
    res = json.loads((run / "results.json").read_text())
    shown = (res.get("valid") or {}).get(job.metric)
    console.print(f"defaults: {job.metric} {shown:.4f} (the config as written, in {run})"
                  if shown is not None else f"defaults: trained in {run}", highlight=False)
    return run


def write_best_yaml(job: TuneJob, values: dict[str, Any], out: Path, header: str) -> Path:
    """The best trial as a config ``sampan train`` takes: the file as written, with the
    trial's values set and its model section written out whole (a changed ``model.name``
    must not keep the old model's options), without the ``tune`` section. When that does not
    load to the trial's exact config (plugins with relative paths...), the trial's resolved
    config is written instead."""
    cfg = trial_config(job.config, job.overrides, values)
    want = dump_config(cfg)
    raw = yaml.safe_load(job.config.read_text()) or {}
    raw.pop("tune", None)
    for item in [*job.overrides, *as_overrides(values)]:
        apply_override(raw, item)
    raw["model"] = cfg.model.model_dump(mode="json")
    text = yaml.safe_dump(raw, sort_keys=False)
    out.write_text(text)
    try:
        same = dump_config(load_config(out)) == want
    except Exception:  # noqa: BLE001 - any failure to load back: write the resolved one
        same = False
    if not same:
        text = want
    out.write_text("".join(f"# {line}\n" for line in header.splitlines()) + text)
    return out


def summarize(job: TuneJob, console: Console, resamples: int = 1000) -> dict[str, Any]:
    """Write ``summary.json`` and ``best.yaml`` and print the study's outcome."""
    from sampan.train.experiment import RunArtifacts, compare_runs

    optuna = _optuna()
    study = job.study()
    c = counts(study)
    finished = [t for t in study.get_trials(deepcopy=False)
                if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    summary: dict[str, Any] = {"study": job.name, "storage": job.storage_url,
                               "metric": job.metric, "direction": job.direction,
                               "budget": job.budget, "trials": c}
    secs = {t.number: float(t.user_attrs.get("seconds", 0.0)) for t in finished}
    pruned = [t for t in finished if t.state == optuna.trial.TrialState.PRUNED]
    full = statistics.median(secs[t.number] for t in complete) if complete else 0.0
    summary["time"] = {
        "trial_seconds": round(sum(secs.values()), 1),
        "median_complete_seconds": round(full, 1),
        "pruned_seconds": round(sum(secs[t.number] for t in pruned), 1),
        # what the pruned trials would have cost had they run to the end like the others
        "saved_seconds_estimate": round(sum(max(0.0, full - secs[t.number]) for t in pruned),
                                        1),
        "pruned_at_epochs": sorted(max(t.intermediate_values) / EPOCH_UNITS
                                   for t in pruned if t.intermediate_values)}
    if not complete:
        (job.folder / "summary.json").write_text(json.dumps(summary, indent=1))
        console.print("no trial has completed yet", highlight=False)
        return summary
    best = study.best_trial
    spec_values = best.user_attrs["values"]
    best_run = job.folder / best.user_attrs["run_dir"]
    summary["best"] = {"trial": best.number, "value": best.value, "params": spec_values,
                       "run_dir": str(best_run)}
    art_best = RunArtifacts(best_run)
    test_best = art_best.evaluate("test", bootstrap=resamples)
    summary["best"]["test"] = test_best
    defaults = job.folder / DEFAULTS
    if (defaults / "results.json").exists():
        res = json.loads((defaults / "results.json").read_text())
        art_def = RunArtifacts(defaults)
        summary["defaults"] = {"run_dir": str(defaults),
                               "value": (res.get("valid") or {}).get(job.metric),
                               "test": art_def.evaluate("test", bootstrap=resamples)}
        if "auc" in test_best:
            summary["best_vs_defaults"] = compare_runs(art_def, art_best, "test", resamples)
    header = (f"sampan tune: the best of {len(finished)} trials of study {job.name!r}, "
              f"trial {best.number}: valid {job.metric} {best.value:.4f}\n"
              f"from {job.config} with: " + (" ".join(as_overrides(spec_values)) or "-"))
    summary["best_yaml"] = str(write_best_yaml(job, spec_values, job.folder / "best.yaml",
                                               header))
    (job.folder / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print_summary(summary, console)
    return summary


def print_summary(s: dict[str, Any], console: Console) -> None:
    c, t = s["trials"], s["time"]
    console.print(f"study {s['study']}: {c['complete']} complete, {c['pruned']} pruned, "
                  f"{c['fail']} failed; trials took {t['trial_seconds']:.0f} s, pruning saved "
                  f"about {t['saved_seconds_estimate']:.0f} s", highlight=False)
    best = s.get("best")
    if not best:
        return
    table = Table(title=f"best: trial {best['trial']} (valid {s['metric']} "
                        f"{best['value']:.4f})")
    for col in ("run", f"valid {s['metric']}", "test auc", "95 % interval"):
        table.add_column(col, justify="left" if col == "run" else "right")

    def row(name: str, value: float | None, test: dict[str, Any]) -> None:
        ci = test.get("auc_ci95")
        table.add_row(name, "-" if value is None else f"{value:.4f}",
                      f"{test['auc']:.4f}" if "auc" in test else "-",
                      f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "-")

    if "defaults" in s:
        row("defaults", s["defaults"]["value"], s["defaults"]["test"])
    row(f"trial {best['trial']}", best["value"], best["test"])
    console.print(table)
    if cmp := s.get("best_vs_defaults"):
        lo, hi = cmp["diff_ci95"]
        console.print(f"test AUC, best - defaults: {cmp['diff']:+.4f}, 95 % interval "
                      f"[{lo:+.4f}, {hi:+.4f}] (paired bootstrap over {cmp['rows']:,} rows; "
                      f"best ahead in {100 * cmp['p_b_better']:.0f} % of resamples)",
                      highlight=False)
    console.print(f"best config: {s['best_yaml']}  (sampan train {s['best_yaml']})",
                  highlight=False)
