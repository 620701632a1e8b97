"""The model contract, for built-in models and for yours.

Every registered model is checked by these functions in Sampan's own test suite; run them on
a model you wrote (see :mod:`sampan.config.plugins`) before you train it::

    from sampan.testing import check_model
    check_model(MyRanker)                       # or check_model("my_ranker", hidden=8)

Each check builds the model on a tiny schema (3 sparse fields, 2 numeric, a behaviour
sequence over field ``c`` called ``hist_c`` and a bag ``genres`` with its own table) and
raises ``AssertionError`` naming what failed: the output is ``[B, T]`` logits with a finite
loss; every parameter gets a gradient and the embedding rows move under the row-sparse
optimizer; a training step is bit-for-bit deterministic; eval mode is deterministic; the
state dict round-trips. A model declares its label count with a class attribute ``tasks``
(default 1).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import torch

from sampan.batch import Batch
from sampan.data.store import SplitArrays
from sampan.embedding import EmbeddingCollection, SparseAdam
from sampan.models import build_model, get_model_class
from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec
from sampan.tasks import make_task, training_loss

SCHEMA = DataSchema(dense=["x1", "x2"],
                    sparse=[SparseFeatureSpec("a", 6), SparseFeatureSpec("b", 4),
                            SparseFeatureSpec("c", 9)],
                    sequences=[SequenceFeatureSpec("hist_c", 5, "c"),
                               SequenceFeatureSpec("genres", 3, "genres", pooling="mean")],
                    own_tables=[SparseFeatureSpec("genres", 7)])


def _cls(model: type | str) -> type:
    return get_model_class(model) if isinstance(model, str) else model


def tasks_of(model: type | str) -> int:
    return getattr(_cls(model), "tasks", 1)


def schema_for(model: type | str, base: DataSchema = SCHEMA) -> DataSchema:
    """The tiny schema, with as many labels as the model needs (most need one)."""
    return dataclasses.replace(base, labels=[f"y{t}" for t in range(tasks_of(model))])


def batch(b: int = 16, seed: int = 0, tasks: int = 1) -> Batch:
    """A batch of the tiny schema (left-padded histories of random length)."""
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


def as_split(b: Batch) -> SplitArrays:
    """A batch as a train split (retrieval tasks read their corpus from it)."""
    return SplitArrays(dense=b.dense.numpy(), sparse=b.sparse.numpy(), labels=b.labels.numpy(),
                       sequences={k: v.numpy() for k, v in b.sequences.items()})


def builder(model: type | str, dim: int = 4, **options: Any) -> Callable[..., torch.nn.Module]:
    """``build(schema=None)``: the model with ``options``, seeded, on the tiny schema."""
    cls = _cls(model)

    def build(schema: DataSchema | None = None, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        cfg = cls.Config(embedding_dim=dim, **options)
        return build_model(cfg, schema or schema_for(cls)) if isinstance(model, str) \
            else cls(schema or schema_for(cls), cfg)

    return build


def check_output_and_loss(model: type | str, **options: Any) -> None:
    m = builder(model, **options)()
    t = tasks_of(model)
    out = m(batch(tasks=t))
    assert out.shape == (16, t), f"{_cls(model).__name__}: output {tuple(out.shape)}, " \
        f"expected [B, T] = (16, {t})"
    task = make_task(m, as_split(batch(tasks=t)))
    loss = training_loss(m, batch(tasks=t), task)
    assert torch.isfinite(loss), f"{_cls(model).__name__}: the loss is {loss.item()}"


def check_every_parameter_learns(model: type | str, **options: Any) -> None:
    name = _cls(model).__name__
    m = builder(model, **options)()
    t = tasks_of(model)
    task = make_task(m, as_split(batch(tasks=t)))
    # One step first so zero-initialised first-order weights do not hide gradients.
    for _ in range(2):
        m.zero_grad()
        b = batch(tasks=t)
        loss = training_loss(m, b, task)
        loss.backward()
        dense = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        for n, p in dense:
            assert p.grad is not None, f"{name}: {n} got no gradient"
        colls = [c for c in m.modules() if isinstance(c, EmbeddingCollection)]
        assert colls, f"{name}: no EmbeddingCollection (sparse ids must go through one)"
        opt = SparseAdam(colls, lr=0.01)
        before = [c.weight.detach().clone() for c in colls]
        pending = [len(c._lookups) for c in colls]
        assert all(pending), f"{name}: embedding lookups recorded no gradient"
        opt.step()
        for c, w in zip(colls, before, strict=True):
            assert not torch.equal(c.weight, w), f"{name}: embedding rows did not move"
        for _, p in dense:
            p.data -= 0.01 * p.grad


def check_training_step_is_deterministic(model: type | str, **options: Any) -> None:
    """The same seed gives bit-identical losses and gradients (dense and row-sparse): runs
    reproduce, and a resumed run continues exactly. The schema and batch are large enough
    for PyTorch's parallel kernels (e.g. indexing backward) to take their threaded paths."""
    name = _cls(model).__name__
    big = dataclasses.replace(
        schema_for(model),
        sparse=[SparseFeatureSpec("a", 60), SparseFeatureSpec("b", 40),
                SparseFeatureSpec("c", 300)],
        sequences=[SequenceFeatureSpec("hist_c", 20, "c"),
                   SequenceFeatureSpec("genres", 3, "genres", pooling="mean")])
    g = torch.Generator().manual_seed(0)
    n, tasks = 512, tasks_of(model)
    b = Batch(dense=torch.randn(n, 2, generator=g),
              sparse=torch.stack([torch.randint(0, s.cardinality, (n,), generator=g)
                                  for s in big.sparse], 1),
              labels=torch.randint(0, 2, (n, tasks), generator=g).float(),
              sequences={"hist_c": torch.randint(0, 300, (n, 20), generator=g),
                         "genres": torch.randint(0, 7, (n, 3), generator=g)})
    train = as_split(b)
    build = builder(model, dim=8, **options)

    def step() -> tuple[torch.Tensor, list[torch.Tensor], list[Any]]:
        m = build(big)
        torch.manual_seed(1)  # dropout masks and sampled negatives
        loss = training_loss(m, b, make_task(m, train))
        loss.backward()
        colls = [c for c in m.modules() if isinstance(c, EmbeddingCollection)]
        return (loss.detach(), [p.grad for p in m.parameters() if p.grad is not None],
                [c.pop_lookups() for c in colls])

    la, ga, sa = step()
    for _ in range(4):  # thread scheduling varies: several tries to see a difference
        lb, gb, sb = step()
        assert torch.equal(la, lb), f"{name}: the loss differs between identical steps"
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True)), \
            f"{name}: dense gradients differ between identical steps"
        for (ra, va), (rb, vb) in zip(sa, sb, strict=True):
            assert torch.equal(ra, rb) and torch.equal(va, vb), \
                f"{name}: sparse gradients differ"


def check_eval_is_deterministic(model: type | str, **options: Any) -> None:
    m = builder(model, **options)().eval()
    with torch.no_grad():
        a, b = m(batch()), m(batch())
    assert torch.equal(a, b), f"{_cls(model).__name__}: eval mode gives different outputs"


def check_state_dict_round_trip(model: type | str, **options: Any) -> None:
    build = builder(model, **options)
    m = build().eval()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    other = build(seed=123).eval()
    other.load_state_dict(torch.load(buf, weights_only=True))
    with torch.no_grad():
        assert torch.equal(m(batch()), other(batch())), \
            f"{_cls(model).__name__}: a loaded state dict does not reproduce the outputs"


def check_deferred_build_matches_plain(model: type | str, **options: Any) -> None:
    """Built with its tables deferred (as a distributed run builds it) and then given its
    values, the model equals a plain build, every tensor. A model that changes its tables'
    values after building them (instead of ``EmbeddingCollection(..., zero_columns=)``)
    fails here: its distributed runs would start from other values."""
    from sampan.distributed.strategy import SingleProcess

    build = builder(model, **options)
    plain = build().state_dict()
    deferred = SingleProcess().parallelize(
        build(schema_for(model).with_table_device("meta"))).state_dict()
    assert sorted(plain) == sorted(deferred), f"{_cls(model).__name__}: other tensors"
    for k, v in plain.items():
        assert torch.equal(v, deferred[k]), (
            f"{_cls(model).__name__}: {k} differs between a plain and a deferred build")


CHECKS = (check_output_and_loss, check_every_parameter_learns,
          check_training_step_is_deterministic, check_eval_is_deterministic,
          check_state_dict_round_trip, check_deferred_build_matches_plain)


def check_model(model: type | str, **options: Any) -> None:
    """Run every contract check on ``model`` (a registered name or a model class, with its
    ``Config`` options); raises ``AssertionError`` naming the first that fails."""
    cls = _cls(model)
    if not hasattr(cls, "Config"):
        raise AssertionError(f"{cls.__name__} must define a nested pydantic `Config` class "
                             "(a subclass of sampan.config.ModelConfig)")
    for check in CHECKS:
        check(model, **options)
