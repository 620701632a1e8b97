"""Every registered model honours the model contract (parametrised from the registry).

The checks live in :mod:`sampan.testing`, where users run them on their own models.
"""

import pytest

from sampan import testing
from sampan.models import get_model_class, model_names

# options a model needs on the tiny schema (everything else at its defaults)
OPTIONS = {"two_tower": {"item_features": ["c", "genres", "x2"]}}


@pytest.fixture(params=model_names())
def name(request):
    return request.param


def test_output_shape_and_finite_loss(name):
    testing.check_output_and_loss(name, **OPTIONS.get(name, {}))


def test_every_parameter_learns(name):
    testing.check_every_parameter_learns(name, **OPTIONS.get(name, {}))


def test_training_step_is_deterministic(name):
    testing.check_training_step_is_deterministic(name, **OPTIONS.get(name, {}))


def test_eval_mode_is_deterministic(name):
    testing.check_eval_is_deterministic(name, **OPTIONS.get(name, {}))


def test_state_dict_round_trip(name):
    testing.check_state_dict_round_trip(name, **OPTIONS.get(name, {}))


def test_a_deferred_build_equals_a_plain_one(name):
    # what a distributed run builds (tables on the meta device, then given their values)
    testing.check_deferred_build_matches_plain(name, **OPTIONS.get(name, {}))


def test_model_name_equals_file_stem(name):
    cls = get_model_class(name)
    assert cls.__module__ == f"sampan.models.{name}"
    assert cls.name == name


def test_numeric_features_alone(name):
    """A model marked ``numeric_only`` trains on numeric features alone (PaddleRec's Census
    models); any other is refused by name when it is built."""
    import torch

    from sampan.batch import Batch
    from sampan.config import ConfigError
    from sampan.models import build_model
    from sampan.schema import DataSchema

    cls = get_model_class(name)
    tasks = testing.tasks_of(name)
    schema = DataSchema(dense=["x", "y", "z"], sparse=[],
                        labels=[f"l{i}" for i in range(tasks)])
    cfg = cls.Config(**OPTIONS.get(name, {}))
    if not getattr(cls, "numeric_only", False):
        with pytest.raises(ConfigError, match=f"model {name!r} embeds categorical features"):
            build_model(cfg, schema)
        return
    model = build_model(cfg, schema)
    b = Batch(dense=torch.randn(8, 3), sparse=torch.zeros(8, 0, dtype=torch.long),
              labels=torch.randint(0, 2, (8, tasks)).float())
    out = model(b)
    assert out.shape == (8, tasks) and torch.isfinite(out).all()
    torch.nn.functional.binary_cross_entropy_with_logits(out, b.labels).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
