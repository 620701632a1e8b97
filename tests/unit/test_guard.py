"""The over-confidence note: a model kept for its AUC whose probabilities got worse than the
LR it started from."""

from sampan.train.guard import overconfidence_note


def results(start: float | None, kept: float) -> dict:
    warm = {} if start is None else {"first_order_warm_start": {"valid": {"logloss": start}}}
    return {**warm, "valid": {"auc": 0.95, "logloss": kept}}


def test_a_kept_model_far_above_its_lr_start_logloss_is_named_with_both_figures():
    note = overconfidence_note(results(0.2821, 0.4206), "auc")
    assert note is not None
    assert "0.4206" in note and "0.2821" in note and "49%" in note
    assert "early_stopping.metric: logloss" in note


def test_no_note_within_the_margin_without_a_warm_start_or_when_stopping_on_logloss():
    assert overconfidence_note(results(0.2821, 0.30), "auc") is None  # 6 % above
    assert overconfidence_note(results(None, 0.4206), "auc") is None
    assert overconfidence_note(results(0.2821, 0.4206), "logloss") is None
    assert overconfidence_note({"valid": {"auc_0": 0.7}}, "auc") is None  # no logloss
