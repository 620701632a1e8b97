"""First-order warm start: an LR fitted first starts the model's linear terms."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from rich.console import Console

from sampan.batch import Batch
from sampan.config import ConfigError, ExperimentConfig, TrainConfig, load_config
from sampan.data.store import SplitArrays
from sampan.layers.embed import first_order_part, lr_start_part
from sampan.models import build_model, get_model_class
from sampan.schema import DataSchema, SparseFeatureSpec
from sampan.train import checkpoint as ckpt
from sampan.train import warm_start
from sampan.train.experiment import run_experiment
from sampan.train.plan import plan_training
from sampan.train.trainer import Trainer
from sampan.train.warm_start import (
    BUDGET_FLOOR,
    BUDGET_SHARE,
    DIRNAME,
    copy_first_order,
    fit_first_order,
    training_estimate,
)
from tests.integration.test_defaults import small_csv

SCHEMA = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 60), SparseFeatureSpec("b", 30)])


def additive_rows(n: int, seed: int) -> SplitArrays:
    """Labels from first-order effects only: what an LR fits exactly."""
    rng = np.random.default_rng(seed)
    weights = np.random.default_rng(99)  # the same world for every split
    wa, wb = weights.normal(0, 1.0, 60), weights.normal(0, 1.0, 30)
    a, b = rng.integers(0, 60, n), rng.integers(0, 30, n)
    x = rng.normal(size=n).astype(np.float32)
    p = 1 / (1 + np.exp(-(wa[a] + wb[b] + 0.5 * x - 1.0)))
    return SplitArrays(dense=x[:, None], sparse=np.stack([a, b], 1),
                       labels=(rng.random((n, 1)) < p[:, None]).astype(np.float32))


def model(name: str):
    torch.manual_seed(0)
    return build_model(get_model_class(name).Config(name=name, embedding_dim=4), SCHEMA)


@pytest.mark.parametrize("name,has", [("fm", True), ("deepfm", True), ("wide_deep", True),
                                      ("xdeepfm", True), ("fibinet", True), ("autoint", True),
                                      ("lr", True), ("dcn_v2", False), ("dcn", False)])
def test_which_models_have_first_order_terms_to_start(name, has):
    assert (first_order_part(model(name)) is not None) is has
    # every one of them starts from an LR: DCN and DCN-V2 through their field vectors
    m = model(name)
    assert lr_start_part(m) is (m.features if has else m.input)


@pytest.mark.parametrize("name,tol", [("deepfm", 5e-3), ("wide_deep", 0.0)])
def test_models_that_add_an_mlp_start_as_the_lr_they_are_given(name, tol):
    """The MLP adds nothing before training: given an LR's weights, the model's logits are
    the LR's (DeepFM's plus its FM term, whose 0.01-scale vectors make it tiny); a randomly
    initialised output layer would add ~0.1 noise. (FiBiNET and xDeepFM keep theirs: see
    :class:`sampan.layers.MLP`.)"""
    lr = model("lr")
    with torch.no_grad():  # an LR with weights of a fitted one's size
        for p in lr.parameters():
            p.normal_(0.0, 0.5)
    m = model(name)
    copy_first_order(lr.features, m)
    rows = additive_rows(256, 5)
    batch = Batch(dense=torch.as_tensor(rows.dense), sparse=torch.as_tensor(rows.sparse))
    with torch.no_grad():
        gap = (m(batch) - lr(batch)).abs().max().item()
    assert gap <= tol + 1e-6


def test_dcn_v2_has_first_order_terms_only_when_asked():
    cls = get_model_class("dcn_v2")
    assert first_order_part(build_model(cls.Config(embedding_dim=4), SCHEMA)) is None
    wide = build_model(cls.Config(embedding_dim=4, first_order=True), SCHEMA)
    assert first_order_part(wide) is wide.features and lr_start_part(wide) is wide.features
    rows = additive_rows(64, 3)
    batch = Batch(dense=torch.as_tensor(rows.dense), sparse=torch.as_tensor(rows.sparse))
    assert wide(batch).shape == (64, 1)
    # stacked: an MLP stands between the vectors and the output; nothing reads an LR there
    stacked = build_model(cls.Config(embedding_dim=4, structure="stacked"), SCHEMA)
    assert lr_start_part(stacked) is None


@pytest.mark.parametrize("name,extra", [("dcn_v2", {}), ("dcn_v2", {"low_rank": 3}),
                                        ("dcn", {})])
def test_dcn_models_start_as_the_lr_exactly_and_every_part_then_learns(name, extra):
    torch.manual_seed(0)
    lr = model("lr")
    with torch.no_grad():
        lr.features.embedding.weight.normal_()
        lr.features.bias.fill_(-1.5)
        lr.features.dense_linear.weight.fill_(0.25)
    m = build_model(get_model_class(name).Config(name=name, embedding_dim=4, mlp=[8],
                                                 **extra), SCHEMA)
    rest = m.input.embedding.weight[:, 1:].clone()
    copy_first_order(lr.features, m)
    assert torch.equal(m.input.embedding.weight[:, :1], lr.features.embedding.weight)
    assert torch.equal(m.input.embedding.weight[:, 1:], rest)  # the other columns as drawn
    rows = additive_rows(256, 3)
    batch = Batch(dense=torch.as_tensor(rows.dense), sparse=torch.as_tensor(rows.sparse),
                  labels=torch.as_tensor(rows.labels))
    # the model computes the LR: bias, id weights and numeric weight, nothing else
    assert torch.allclose(m(batch), lr(batch), atol=1e-6)
    assert m.output_bias()[0][0].item() == -1.5
    # the crosses, the MLP and the output layer's other weights all get gradients: two
    # Adam steps move every dense parameter off its start
    start = {k: v.detach().clone() for k, v in m.named_parameters() if "embedding" not in k}
    opt = torch.optim.Adam([p for k, p in m.named_parameters() if k in start], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(m(batch), batch.labels)
        loss.backward()
        opt.step()
    moved = {k for k, p in m.named_parameters() if k in start and not torch.equal(p, start[k])}
    assert moved == set(start)


def test_plan_turns_it_on_only_where_it_applies():
    y = np.zeros((500, 1))
    y[:200] = 1
    assert plan_training(TrainConfig(), 4000, y, first_order=True).train.first_order_warm_start
    off = plan_training(TrainConfig(), 4000, None, first_order=True)
    assert off.train.first_order_warm_start is False
    assert "no validation split" in off.reasons["first_order_warm_start"]
    assert plan_training(TrainConfig(), 4000, y, first_order=False).train \
        .first_order_warm_start is False
    assert plan_training(TrainConfig(), 4000, y, world=2, first_order=True).train \
        .first_order_warm_start  # distributed too
    assert plan_training(TrainConfig(first_order_warm_start=False), 4000, y,
                         first_order=True).train.first_order_warm_start is False
    with pytest.raises(ConfigError, match="no first-order terms"):
        plan_training(TrainConfig(first_order_warm_start=True), 4000, y, first_order=False)


def test_copy_takes_the_lr_weights_and_leaves_the_vectors():
    lr, fm = model("lr"), model("fm")
    with torch.no_grad():
        lr.features.embedding.weight.normal_()
        lr.features.bias.fill_(-1.5)
        lr.features.dense_linear.weight.fill_(0.25)
    vectors = fm.features.embedding.weight[:, 1:].clone()
    copy_first_order(lr.features, fm)
    assert torch.equal(fm.features.embedding.weight[:, :1], lr.features.embedding.weight)
    assert torch.equal(fm.features.embedding.weight[:, 1:], vectors)
    assert fm.features.bias.item() == -1.5
    assert torch.equal(fm.features.dense_linear.weight, lr.features.dense_linear.weight)
    with pytest.raises(RuntimeError, match="same schema"):
        other = build_model(get_model_class("lr").Config(name="lr"),
                            DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 7)]))
        copy_first_order(other.features, fm)


def warm_trainer(tmp_path, name: str, solver: str, **train):
    """A Trainer of ``name`` on the additive rows, warm start on (auto), and its valid rows.
    The warm start has no time bound unless ``first_order_seconds`` is given: what the
    tests check must not depend on the machine's load."""
    train.setdefault("first_order_seconds", None)
    cfg = ExperimentConfig.model_validate({
        "features": {"categorical": ["a", "b"], "numeric": ["x"]},
        "model": {"name": name, **({"embedding_dim": 4} if name != "lr" else {})},
        "train": {"batch_size": 128, "epochs": 2, "progress": False, "tensorboard": False,
                  "eval_every_steps": 10, "first_order_solver": solver, **train}})
    train, valid = additive_rows(4000, 1), additive_rows(1500, 2)
    trainer = Trainer(model(name), cfg, tmp_path, train, valid, console=Console(quiet=True))
    # (an lr model under sgd has none: see the next-but-one test)
    assert trainer.tc.first_order_warm_start or (name, solver) == ("lr", "sgd")
    return trainer, valid


@pytest.mark.parametrize("solver", ["lbfgs", "sgd"])
def test_the_model_starts_as_the_fitted_lr_and_never_ends_below_it(tmp_path, solver):
    trainer, valid = warm_trainer(tmp_path, "fm", solver)
    fm = trainer.model
    report = fit_first_order(trainer)
    # what was copied is the LR's best checkpoint, bit for bit
    best = ckpt.load(tmp_path / DIRNAME / "checkpoints" / "best.pt")["model"]
    assert torch.equal(fm.features.embedding.weight[:, :1], best["features.embedding.weight"])
    assert torch.equal(fm.features.bias, best["features.bias"])
    vectors = fm.features.embedding.weight[:, 1:].clone()
    assert report["solver"] == solver
    if solver == "sgd":  # the LR trained to its own early stop (epochs: auto), not 2 epochs
        assert report["steps"] > 2 * len(trainer.loader)
    else:  # C chosen on validation: the best of the path it tried
        assert report["C"] in [p["C"] for p in report["path"]]
        assert report["valid"]["auc"] == max(p["auc"] for p in report["path"])
    state = trainer.fit()
    first = state.history[0]
    assert first["step"] == 0
    # at step 0 the model is the LR (its vectors are tiny): the same validation AUC
    assert first["auc"] == pytest.approx(report["valid"]["auc"], abs=2e-3)
    # the run keeps its best evaluation, and the LR's is one of them: the floor
    assert state.best >= first["auc"]
    assert trainer.evaluate(valid)["auc"] == pytest.approx(state.best, abs=1e-9)
    # after an exact fit the ids' first-order weights stayed the LR's (first_order_frozen);
    # an SGD fit's, stopped early, train on; the vectors trained
    table = fm.features.embedding.weight
    if solver == "lbfgs":
        assert report["frozen"]
        assert torch.equal(table[:, :1], best["features.embedding.weight"])
    else:
        assert "frozen" not in report and not trainer.sparse_opt.frozen_columns
    assert state.best_step == 0 or not torch.equal(table[:, 1:], vectors)


def test_a_dcn_v2_run_starts_as_the_exact_lr_and_its_vectors_carry_it_on(tmp_path):
    trainer, valid = warm_trainer(tmp_path, "dcn_v2", "lbfgs")
    report = fit_first_order(trainer)
    # the LR's weights sit in the vectors, which keep training: nothing is frozen
    assert "frozen" not in report and not trainer.sparse_opt.frozen_columns
    lr_weights = trainer.model.input.embedding.weight[:, :1].clone()
    state = trainer.fit()
    first = state.history[0]
    # at step 0 the model is exactly the fitted LR
    assert first["step"] == 0 and first["auc"] == pytest.approx(report["valid"]["auc"],
                                                                abs=1e-6)
    assert state.best >= first["auc"]
    assert state.best_step == 0 or not torch.equal(
        trainer.model.input.embedding.weight[:, :1], lr_weights)


def test_first_order_frozen_keeps_the_lr_weights_and_false_trains_them(tmp_path):
    table = {}
    for frozen in (True, False):
        trainer, _ = warm_trainer(tmp_path / str(frozen), "fm", "lbfgs",
                                  first_order_frozen=frozen)
        fit_first_order(trainer)
        table[frozen] = trainer.model.features.embedding.weight
        lr_weights = table[frozen][:, :1].clone()
        for batch in itertools.islice(trainer.loader, 5):
            trainer._train_step(batch)
        assert torch.equal(table[frozen][:, :1], lr_weights) is frozen
        # the freeze is optimizer state: a resumed run's optimizer keeps it
        again, _ = warm_trainer(tmp_path / f"again{frozen}", "fm", "lbfgs")
        again.sparse_opt.load_state_dict(trainer.sparse_opt.state_dict())
        assert bool(again.sparse_opt.frozen_columns) is frozen


def test_a_run_reports_it_and_false_turns_it_off(tmp_path):
    small_csv(tmp_path / "d.csv", rows=1200)
    raw = {"name": "warm", "output_dir": str(tmp_path / "runs"),
           "data": {"train": str(tmp_path / "d.csv")},
           "features": {"categorical": ["a", "b"], "numeric": ["x"]},
           "model": {"name": "deepfm", "mlp": [8]},
           "train": {"progress": False, "tensorboard": False}}
    run = tmp_path / "run"
    res = run_experiment(load_config(raw=raw), run_dir=run, console=Console(quiet=True))
    warm = res["first_order_warm_start"]
    assert warm["solver"] == "lbfgs" and warm["passes"] > 0  # auto: exact on one process
    assert json.loads((run / "results.json").read_text())["first_order_warm_start"] == warm
    assert json.loads((run / "schedule.json").read_text())["chosen"]["first_order_warm_start"]
    assert (run / DIRNAME / "checkpoints" / "best.pt").exists()
    # explicit false: no LR stage
    raw["train"]["first_order_warm_start"] = False
    res = run_experiment(load_config(raw=raw), run_dir=tmp_path / "off",
                         console=Console(quiet=True))
    assert "first_order_warm_start" not in res
    assert not (tmp_path / "off" / DIRNAME).exists()


def test_lbfgs_where_it_cannot_run_fails_naming_why(tmp_path):
    cfg = ExperimentConfig.model_validate({
        "features": {"categorical": ["a", "b"], "numeric": ["x"]},
        "model": {"name": "fm", "embedding_dim": 4},
        "train": {"batch_size": 128, "epochs": 1, "progress": False, "tensorboard": False,
                  "first_order_warm_start": True, "first_order_solver": "lbfgs"}})
    trainer = Trainer(model("fm"), cfg, tmp_path, additive_rows(500, 1), None,
                      console=Console(quiet=True))
    with pytest.raises(ConfigError, match="lbfgs cannot fit.*no validation split"):
        fit_first_order(trainer)
    # auto falls back to SGD and says why
    cfg.train.first_order_solver = "auto"
    trainer = Trainer(model("fm"), cfg, tmp_path / "auto", additive_rows(500, 1), None,
                      console=Console(quiet=True))
    assert fit_first_order(trainer)["solver"] == "sgd"


@pytest.mark.parametrize("solver", ["lbfgs", "sgd"])
def test_the_lr_model_starts_as_the_exact_lr_and_skips_an_sgd_one(tmp_path, solver):
    # the lr model is its first-order part: the exact fit is its start; an SGD fit would be
    # the model itself trained twice, so it is skipped
    trainer, _ = warm_trainer(tmp_path, "lr", solver)
    report = fit_first_order(trainer)
    if solver == "sgd":  # the schedule says so, and asked anyway the fit is skipped
        assert not trainer.tc.first_order_warm_start
        assert "an SGD fit of it would be the model itself" in \
            trainer.plan.reasons["first_order_warm_start"]
        assert report is None and trainer.warm_start is None
        assert not (tmp_path / DIRNAME).exists()
        return
    assert report["solver"] == "lbfgs" and trainer.warm_start is report
    state = trainer.fit()
    first = state.history[0]
    # at step 0 the model is exactly the fitted LR
    assert first["step"] == 0 and first["auc"] == pytest.approx(report["valid"]["auc"],
                                                                abs=1e-6)
    assert state.best >= first["auc"]


@pytest.mark.parametrize("aucs,evals,best_at", [
    # below the LR at first, then climbing back on its own: patience restarts until the
    # model beats the LR (0.71), then it is stopped two evaluations after that
    ([0.70, 0.68, 0.69, 0.71, 0.70, 0.705], 6, 3),
    # never climbing back: stopped after two trained evaluations, the LR kept
    ([0.70, 0.69, 0.68], 3, 0)])
def test_patience_counts_from_the_trained_models_own_best(tmp_path, aucs, evals, best_at):
    trainer, _ = warm_trainer(tmp_path, "fm", "lbfgs", early_stopping={"patience": 2},
                              epochs=5)
    fit_first_order(trainer)
    real, script = trainer.evaluate, iter(aucs)

    def scripted(data):  # the real metrics, with the AUC the test scripts
        return {**real(data), "auc": next(script, 0.5)}

    trainer.evaluate = scripted
    state = trainer.fit()
    assert [round(r["auc"], 3) for r in state.history] == aucs[:evals]
    assert state.stopped_early
    assert state.best_step == state.history[best_at]["step"]
    assert state.best == aucs[best_at]


def test_an_exact_fit_is_bounded_by_the_training_it_precedes(tmp_path, monkeypatch):
    # a design this small is not bounded: it fits in seconds, the same on every machine
    small, _ = warm_trainer(tmp_path / "small", "fm", "lbfgs", first_order_seconds="auto")
    small.console = Console(record=True, width=300)
    free = fit_first_order(small)
    assert "budget_seconds" not in free and "training_estimate" not in free
    assert "(no time bound: " in small.console.export_text()
    monkeypatch.setattr(warm_start, "UNBOUNDED_NONZEROS", 0)  # as a large design is
    trainer, _ = warm_trainer(tmp_path / "roomy", "fm", "lbfgs", first_order_seconds="auto")
    # the estimate: a run that improves for two epochs and stops its patience later
    estimate, steps = training_estimate(trainer)
    tc = trainer.tc
    assert steps == min(trainer.total_steps, 2 * len(trainer.loader)
                        + tc.early_stopping.patience * tc.eval_every_steps) and estimate > 0
    report = fit_first_order(trainer)
    assert report["budget_seconds"] == pytest.approx(
        max(BUDGET_FLOOR, BUDGET_SHARE * report["training_estimate"]["seconds"]), abs=0.01)
    assert report["training_estimate"]["steps"] == steps and "cut" not in report
    # a budget it cannot meet: the first C's solve, cut short, is kept, and its weights
    # train on (no optimum); the header says so
    monkeypatch.setattr(warm_start, "BUDGET_FLOOR", 0.0)
    monkeypatch.setattr(warm_start, "BUDGET_SHARE", 0.0)
    tight, _ = warm_trainer(tmp_path / "tight", "fm", "lbfgs", first_order_seconds="auto")
    tight.console = Console(record=True, width=200)
    cut = fit_first_order(tight)
    assert cut["cut"] == "solution" and len(cut["path"]) == 1 < len(report["path"])
    assert "frozen" not in cut and report["frozen"]
    shown = " ".join(tight.console.export_text().split())
    assert "the time budget cut its solve short" in shown and \
        f"of its {cut['budget_seconds']:.1f} s budget" in shown
    # the lr model's exact fit is the model: not bounded
    lr, _ = warm_trainer(tmp_path / "lr", "lr", "lbfgs", first_order_seconds="auto")
    assert "budget_seconds" not in fit_first_order(lr)


@pytest.mark.parametrize("solver", ["lbfgs", "sgd"])
def test_a_budget_of_the_users_and_none(tmp_path, solver):
    given, _ = warm_trainer(tmp_path / "given", "fm", solver, first_order_seconds=300)
    out = fit_first_order(given)
    assert out["budget_seconds"] == 300 and "training_estimate" not in out
    assert "cut" not in out
    free, _ = warm_trainer(tmp_path / "free", "fm", solver, first_order_seconds=None)
    assert "budget_seconds" not in fit_first_order(free)
    # auto bounds an SGD fit by its early stopping alone (in steps: reruns and a
    # distributed run's processes stop alike); a number stops it at its next evaluation
    if solver == "sgd":
        auto, _ = warm_trainer(tmp_path / "auto", "fm", solver, first_order_seconds="auto")
        assert "budget_seconds" not in fit_first_order(auto)
        tight, _ = warm_trainer(tmp_path / "tight", "fm", solver,
                                first_order_seconds=1e-6)
        tight.console = Console(record=True, width=200)
        cut = fit_first_order(tight)
        assert cut["cut"] and cut["steps"] == tight.tc.eval_every_steps < out["steps"]
        assert "the time budget stopped it" in " ".join(tight.console.export_text().split())


def test_timing_training_steps_leaves_the_run_as_it_was(tmp_path):
    # the estimate takes real steps (both optimizers, Adam's moments) and undoes them: a
    # run that timed them trains exactly as one that did not
    timed, _ = warm_trainer(tmp_path / "timed", "deepfm", "lbfgs", max_steps=20)
    plain, _ = warm_trainer(tmp_path / "plain", "deepfm", "lbfgs", max_steps=20)
    before = {k: v.clone() for k, v in timed.model.state_dict().items()}
    assert timed.step_seconds() > 0
    after = timed.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not timed.sparse_opt.state and not timed.dense_opt.state
    timed.fit(), plain.fit()
    for (k, a), b in zip(timed.model.state_dict().items(),
                         plain.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
