"""The task <-> model contract is declared (sampan.tasks.base) and checked, not guessed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sampan.config import ConfigError
from sampan.tasks import BinaryTask, RetrievalModel, Task, make_task, model_outputs
from sampan.testing import as_split, batch, builder
from tests.contract.test_models import OPTIONS


def test_both_tasks_meet_the_task_protocol():
    assert isinstance(BinaryTask(), Task)
    two_tower = builder("two_tower", **OPTIONS["two_tower"])()
    assert isinstance(two_tower, RetrievalModel)
    assert isinstance(make_task(two_tower, as_split(batch())), Task)


def test_a_retrieval_model_missing_part_of_its_contract_is_named():
    class Half(nn.Module):
        task = "retrieval"
        k, exclude_seen, item_column, user_column = 10, False, 0, 1

        def user_vectors(self, b):
            return torch.zeros(len(b.sparse), 4)

    with pytest.raises(ConfigError, match=r"lacks \['temperature', 'logq_correction'.*"
                                          r"'item_vectors', 'vectors'\]"):
        make_task(Half(), as_split(batch()))
    with pytest.raises(ConfigError, match="unknown task 'ranking'"):
        make_task(type("M", (nn.Module,), {"task": "ranking"})())


def test_an_auxiliary_loss_is_returned_not_left_on_the_model():
    dien = builder("dien")()
    b = batch()
    dien.train()
    logits, aux = model_outputs(dien, b)
    assert logits.shape == (16, 1) and aux is not None and aux.ndim == 0 and aux > 0
    assert not hasattr(dien, "aux_loss")  # no state carried from one forward to the next
    # the task adds it: the training loss is the binary loss plus the auxiliary one
    from sampan.tasks import binary_loss

    torch.manual_seed(0)
    loss = BinaryTask().loss(dien, b)
    torch.manual_seed(0)
    z, a = dien.forward_with_aux(b)
    assert loss.item() == pytest.approx((binary_loss(z, b.labels) + a).item(), rel=1e-6)
    dien.eval()
    assert model_outputs(dien, b)[1] is None
    assert torch.equal(dien(b), dien.forward_with_aux(b)[0])  # forward is the scoring graph
    fm = builder("fm")()
    assert model_outputs(fm, b)[1] is None


def test_dcn_cross_l2_adds_paddlerecs_cross_penalty_in_training_only():
    b = batch()
    dcn = builder("dcn", cross_layers=2, cross_l2=0.01)()
    dcn.train()
    logits, aux = model_outputs(dcn, b)
    assert torch.equal(logits, dcn(b))  # the same scoring graph
    # by hand: x_{l+1} = x0 (x_l . w_l) + b_l + x_l; penalty = sum_l sum ||x_l * w_l||^2
    x0 = dcn.input(b)
    x, want = x0, 0.0
    for w, bias in zip(dcn.cross.w, dcn.cross.b, strict=True):
        want += float((x * w).pow(2).sum())
        x = x0 * (x @ w).unsqueeze(1) + bias + x
    assert aux.item() == pytest.approx(0.01 * want, rel=1e-5)
    dcn.eval()
    assert model_outputs(dcn, b)[1] is None
    assert model_outputs(builder("dcn", cross_layers=2)().train(), b)[1] is None
