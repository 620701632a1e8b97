"""Every registered model honours the model contract (parametrised from the registry)."""

import dataclasses
import io

import pytest
import torch

from sampan.batch import Batch
from sampan.embedding import EmbeddingCollection, SparseAdam
from sampan.models import build_model, get_model_class, model_names
from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec
from sampan.tasks import make_task, training_loss

SCHEMA = DataSchema(dense=["x1", "x2"],
                    sparse=[SparseFeatureSpec("a", 6), SparseFeatureSpec("b", 4),
                            SparseFeatureSpec("c", 9)],
                    sequences=[SequenceFeatureSpec("hist_c", 5, "c"),
                               SequenceFeatureSpec("genres", 3, "genres", pooling="mean")],
                    own_tables=[SparseFeatureSpec("genres", 7)])


def schema_for(name):
    """The tiny schema, with as many labels as the model needs (most need one)."""
    tasks = getattr(get_model_class(name), "tasks", 1)
    return dataclasses.replace(SCHEMA, labels=[f"y{t}" for t in range(tasks)])


def batch(b=16, seed=0, tasks=1):
    g = torch.Generator().manual_seed(seed)
    sparse = torch.stack([torch.randint(0, s.cardinality, (b,), generator=g)
                          for s in SCHEMA.sparse], 1)
    hist = torch.randint(1, 9, (b, 5), generator=g)
    lengths = torch.randint(0, 6, (b,), generator=g)
    hist[torch.arange(5).expand(b, 5) < (5 - lengths).unsqueeze(1)] = 0  # left padding
    return Batch(dense=torch.randn(b, 2, generator=g), sparse=sparse,
                 labels=torch.randint(0, 2, (b, tasks), generator=g).float(),
                 sequences={"hist_c": hist,
                            "genres": torch.randint(0, 7, (b, 3), generator=g)})


# options a model needs on the tiny schema (everything else at its defaults)
OPTIONS = {"two_tower": {"item_features": ["c", "genres", "x2"]}}


def config(name):
    return get_model_class(name).Config(embedding_dim=4, **OPTIONS.get(name, {}))


def build(name):
    torch.manual_seed(0)
    return build_model(config(name), schema_for(name))


def train_arrays(tasks=1):
    """The contract batch as a train split (retrieval tasks read their corpus from it)."""
    from sampan.data.store import SplitArrays

    b = batch(tasks=tasks)
    return SplitArrays(dense=b.dense.numpy(), sparse=b.sparse.numpy(), labels=b.labels.numpy(),
                       sequences={k: v.numpy() for k, v in b.sequences.items()})


def tasks_of(name):
    return getattr(get_model_class(name), "tasks", 1)


@pytest.fixture(params=model_names())
def name(request):
    return request.param


def test_output_shape_and_finite_loss(name):
    model = build(name)
    out = model(batch(tasks=tasks_of(name)))
    assert out.shape == (16, tasks_of(name))
    task = make_task(model, train_arrays(tasks_of(name)))
    loss = training_loss(model, batch(tasks=tasks_of(name)), task)
    assert torch.isfinite(loss)


def test_every_parameter_learns(name):
    model = build(name)
    task = make_task(model, train_arrays(tasks_of(name)))
    # One step first so zero-initialised first-order weights do not hide gradients.
    for _ in range(2):
        model.zero_grad()
        b = batch(tasks=tasks_of(name))
        loss = training_loss(model, b, task)
        loss.backward()
        dense = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for n, p in dense:
            assert p.grad is not None, f"{name}: {n} got no gradient"
        colls = [m for m in model.modules() if isinstance(m, EmbeddingCollection)]
        assert colls, f"{name}: no EmbeddingCollection"
        opt = SparseAdam(colls, lr=0.01)
        before = [c.weight.detach().clone() for c in colls]
        pending = [len(c._lookups) for c in colls]
        assert all(pending), f"{name}: embedding lookups recorded no gradient"
        opt.step()
        for c, w in zip(colls, before, strict=True):
            assert not torch.equal(c.weight, w), f"{name}: embedding rows did not move"
        for _, p in dense:
            p.data -= 0.01 * p.grad


def test_training_step_is_deterministic(name):
    """The same seed gives bit-identical losses and gradients (dense and row-sparse): runs
    reproduce, and a resumed run continues exactly. The schema and batch are large enough
    for PyTorch's parallel kernels (e.g. indexing backward) to take their threaded paths."""
    big = dataclasses.replace(
        schema_for(name),
        sparse=[SparseFeatureSpec("a", 60), SparseFeatureSpec("b", 40),
                SparseFeatureSpec("c", 300)],
        sequences=[SequenceFeatureSpec("hist_c", 20, "c"),
                   SequenceFeatureSpec("genres", 3, "genres", pooling="mean")])
    g = torch.Generator().manual_seed(0)
    n, tasks = 512, tasks_of(name)
    b = Batch(dense=torch.randn(n, 2, generator=g),
              sparse=torch.stack([torch.randint(0, s.cardinality, (n,), generator=g)
                                  for s in big.sparse], 1),
              labels=torch.randint(0, 2, (n, tasks), generator=g).float(),
              sequences={"hist_c": torch.randint(0, 300, (n, 20), generator=g),
                         "genres": torch.randint(0, 7, (n, 3), generator=g)})
    from sampan.data.store import SplitArrays

    train = SplitArrays(dense=b.dense.numpy(), sparse=b.sparse.numpy(),
                        labels=b.labels.numpy(), sequences={k: v.numpy() for k, v in
                                                            b.sequences.items()})

    def step():
        torch.manual_seed(0)
        model = build_model(get_model_class(name).Config(embedding_dim=8,
                                                         **OPTIONS.get(name, {})), big)
        torch.manual_seed(1)  # dropout masks and sampled negatives
        loss = training_loss(model, b, make_task(model, train))
        loss.backward()
        colls = [m for m in model.modules() if isinstance(m, EmbeddingCollection)]
        return (loss.detach(), [p.grad for p in model.parameters() if p.grad is not None],
                [c.pop_lookups() for c in colls])

    la, ga, sa = step()
    for _ in range(4):  # thread scheduling varies: several tries to see a difference
        lb, gb, sb = step()
        assert torch.equal(la, lb)
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
        for (ra, va), (rb, vb) in zip(sa, sb, strict=True):
            assert torch.equal(ra, rb) and torch.equal(va, vb), \
                f"{name}: sparse gradients differ"


def test_eval_mode_is_deterministic(name):
    model = build(name).eval()
    with torch.no_grad():
        a, b = model(batch()), model(batch())
    assert torch.equal(a, b)


def test_state_dict_round_trip(name):
    model = build(name).eval()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(123)
    other = build_model(config(name), schema_for(name)).eval()
    other.load_state_dict(torch.load(buf, weights_only=True))
    with torch.no_grad():
        assert torch.equal(model(batch()), other(batch()))


def test_model_name_equals_file_stem(name):
    cls = get_model_class(name)
    assert cls.__module__ == f"sampan.models.{name}"
    assert cls.name == name
