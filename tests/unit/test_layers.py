import itertools

import pytest
import torch

from sampan.embedding import EmbeddingCollection
from sampan.layers import Dice, FieldWeightedFM, TargetAttention, fm_interaction
from sampan.models.dcn_v2 import CrossNetV2
from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec


def test_fm_interaction_equals_explicit_pairs():
    v = torch.randn(3, 5, 4)
    want = torch.stack([sum((v[b, i] * v[b, j]).sum() for i, j in
                            itertools.combinations(range(5), 2)) for b in range(3)])
    torch.testing.assert_close(fm_interaction(v).squeeze(1), want)


def test_cross_net_v2_equals_formula():
    torch.manual_seed(0)
    net = CrossNetV2(6, 2)
    x0 = torch.randn(4, 6)
    x1 = x0 * (x0 @ net.w[0].weight.T + net.w[0].bias) + x0
    x2 = x0 * (x1 @ net.w[1].weight.T + net.w[1].bias) + x1
    torch.testing.assert_close(net(x0), x2)


@pytest.mark.parametrize("kernel", ["mkl", "onednn", "onednn/mkl/onednn"])
@pytest.mark.parametrize("contiguous_grad", [True, False])
def test_cross_net_v2_in_one_node_has_the_gradients_of_the_formula(kernel, contiguous_grad):
    """The full-rank cross network's own backward (one autograd node, each input gradient
    added inside its GEMM) against autograd through the formula, on each library; the
    upstream gradient contiguous (then it is not written into) or a view."""
    from sampan.layers.linear import onednn_available

    torch.manual_seed(0)
    net = CrossNetV2(37, 3)
    for w in net.w:
        w.kernel = kernel
    x0 = torch.randn(300, 37, requires_grad=True)
    out = net(x0)
    assert (type(out.grad_fn).__name__ == "_CrossNetBackward") == onednn_available()
    up = torch.randn(300, 74)[:, ::2] if not contiguous_grad else torch.randn(300, 37)
    kept = up.clone()
    got = torch.autograd.grad(out, [x0, *net.parameters()], up)
    assert torch.equal(up, kept)  # the caller's gradient is left as it was
    x = x0
    for w in net.w:
        x = x0 * (x @ w.weight.T + w.bias) + x
    want = torch.autograd.grad(x, [x0, *net.parameters()], up)
    torch.testing.assert_close(out, x)
    for a, b in zip(got, want, strict=True):  # fp32 sums over 300 rows in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6 * b.abs().max().item())


def test_fm_interaction_in_parts_has_the_gradient_of_the_plain_formula():
    torch.manual_seed(0)
    a = torch.randn(6, 4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 1, dtype=torch.float64)
    got = fm_interaction(a, b)
    ga, gb = torch.autograd.grad(got, (a, b), up)
    v = torch.cat([a, b], dim=1)
    s = v.sum(dim=1)
    want = 0.5 * (s.square() - v.square().sum(dim=1)).sum(dim=1, keepdim=True)
    wa, wb = torch.autograd.grad(want, (a, b), up)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ga, wa)
    torch.testing.assert_close(gb, wb)
    assert torch.autograd.gradcheck(fm_interaction, (a.detach().requires_grad_(), b.detach()))
    with torch.no_grad():
        torch.testing.assert_close(fm_interaction(a, b), want)


def test_field_weighted_fm_weights_each_pair_and_starts_as_the_plain_fm():
    torch.manual_seed(0)
    a = torch.randn(3, 4, 5, dtype=torch.float64)
    b = torch.randn(3, 2, 5, dtype=torch.float64)
    layer = FieldWeightedFM(6).double()
    torch.testing.assert_close(layer(a, b), fm_interaction(a, b))  # weights 1: Rendle's FM
    with torch.no_grad():
        layer.weight.copy_(torch.randn(6, 6, dtype=torch.float64))
    v = torch.cat([a, b], dim=1)
    want = torch.stack([sum(layer.weight[i, j] * (v[n, i] * v[n, j]).sum()
                            for i, j in itertools.combinations(range(6), 2)) for n in range(3)])
    torch.testing.assert_close(layer(a, b).squeeze(1), want)  # the lower triangle is unused
    assert torch.autograd.gradcheck(layer, (a.requires_grad_(), b.requires_grad_()))
    with pytest.raises(ValueError, match="built for 6 fields, got 4"):
        layer(a)


def test_a_model_saved_without_field_weights_loads_as_the_plain_fm():
    layer = FieldWeightedFM(3)
    with torch.no_grad():
        layer.weight.zero_()
    layer.load_state_dict({})  # what an FM saved before field weights holds for it
    assert torch.equal(layer.weight, torch.ones(3, 3))


@pytest.mark.parametrize("normalization", ["none", "softmax"])
def test_target_attention_ignores_padding(normalization):
    torch.manual_seed(0)
    att = TargetAttention(4, [8], "relu", normalization).eval()
    q, k = torch.randn(2, 4), torch.randn(2, 3, 4)
    mask = torch.tensor([[False, True, True], [False, False, False]])
    out = att.pool(att(q, k, mask), k)
    k2 = k.clone()
    k2[~mask] = 100.0  # whatever sits in padded slots
    torch.testing.assert_close(att.pool(att(q, k2, mask), k2), out)
    assert torch.equal(out[1], torch.zeros(4))


@pytest.mark.parametrize("act", ["relu", "dice"])
def test_target_attention_first_layer_equals_the_four_part_input(act):
    # [q, k, q*k] @ [Wq + Wd, Wk - Wd, Wp]^T is [q, k, q - k, q*k] @ W^T: values and gradients
    torch.manual_seed(0)
    att = TargetAttention(6, [8, 4], act)
    q, k = torch.randn(5, 6), torch.randn(5, 7, 6)
    got = att.scores(q, k)
    got.sum().backward()
    grads = [p.grad.clone() for p in att.parameters()]
    att.zero_grad()
    qe = q.unsqueeze(1).expand_as(k)
    want = att.mlp(torch.cat([qe, k, qe - k, qe * k], dim=-1)).squeeze(-1)
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, p in zip(grads, att.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


def test_dice_matches_formula_in_eval():
    d = Dice(3).eval()
    d.alpha.data = torch.tensor([0.1, 0.2, 0.3])
    x = torch.randn(5, 2, 3)
    p = torch.sigmoid(x / torch.sqrt(torch.tensor(1.0 + 1e-8)))  # running stats: mean 0, var 1
    torch.testing.assert_close(d(x), p * x + (1 - p) * d.alpha * x)


def test_sequences_share_their_feature_table():
    schema = DataSchema(sparse=[SparseFeatureSpec("user", 4), SparseFeatureSpec("item", 7)],
                        sequences=[SequenceFeatureSpec("hist", 3, "item")])
    coll = EmbeddingCollection(schema.tables(5), init_std=1.0)
    ids = torch.tensor([[1, 2], [3, 6]])
    hist = torch.tensor([[0, 6, 2], [5, 5, 1]])
    for mode in (coll.eval, coll.train):
        mode()
        e, seqs = coll.lookup(ids, {"hist": hist})
        item_rows = coll.weight[4:11]
        torch.testing.assert_close(seqs["hist"], item_rows[hist])
        torch.testing.assert_close(e[:, 1], item_rows[ids[:, 1]])
    rows, _ = (coll._lookups[-1][0], None)
    # one deduplicated gather covers both: item 2 and item 6 appear in sparse and history
    assert sorted(rows.tolist()) == sorted({1, 3, 4 + 2, 4 + 6, 4 + 0, 4 + 5, 4 + 1})


def test_history_and_target_resolution_and_errors():
    import pytest

    schema = DataSchema(sparse=[SparseFeatureSpec("user", 4), SparseFeatureSpec("item", 7)],
                        sequences=[SequenceFeatureSpec("hist", 3, "item")])
    assert schema.history_and_target("din", None, None) == ("hist", 1)
    with pytest.raises(ValueError, match="din: model.history must name one of"):
        schema.history_and_target("din", "nope", None)
    with pytest.raises(ValueError, match="holds ids of 'item', not of the target 'user'"):
        schema.history_and_target("bst", "hist", "user")
    with pytest.raises(ValueError, match="needs a behaviour sequence"):
        DataSchema(sparse=[SparseFeatureSpec("u", 2)]).history_and_target("din", None, None)


def test_feature_embedding_without_first_order_and_autoint_linear_switch():
    import pytest

    from sampan.batch import Batch
    from sampan.layers import FeatureEmbedding
    from sampan.models.autoint import AutoInt

    schema = DataSchema(dense=["x", "y"], sparse=[SparseFeatureSpec("a", 5),
                                                  SparseFeatureSpec("b", 3)])
    b = Batch(dense=torch.randn(4, 2), sparse=torch.tensor([[2, 1], [3, 2], [4, 1], [2, 2]]),
              labels=torch.ones(4, 1))
    both = FeatureEmbedding(schema, dim=3)
    vec_only = FeatureEmbedding(schema, dim=3, first_order=False)
    assert vec_only.embedding.weight.shape[1] == 3 and both.embedding.weight.shape[1] == 4
    assert vec_only.bias is None and vec_only.dense_linear is None
    torch.manual_seed(0)
    lin, v = both(b)
    none, v2 = vec_only(b)
    assert none is None and lin.shape == (4, 1) and v.shape == v2.shape == (4, 4, 3)
    with pytest.raises(ValueError, match="dim > 0 or first_order"):
        FeatureEmbedding(schema, dim=0, first_order=False)
    # AutoInt's first-order term is exactly the features' linear output, added to the logit
    for linear in (True, False):
        torch.manual_seed(0)
        m = AutoInt(schema, AutoInt.Config(embedding_dim=3, mlp=[4], linear=linear))
        m(b).sum().backward()
        # the fused table is updated row-sparsely (not through .grad); the rest is dense
        missing = [n for n, p in m.named_parameters() if p.requires_grad and p.grad is None]
        assert missing == [], missing
        assert ("features.bias" in dict(m.named_parameters())) is linear
    # with the attention output zeroed, AutoInt's logit is exactly its first-order term
    m_lin = AutoInt(schema, AutoInt.Config(embedding_dim=3, mlp=[], linear=True))
    with torch.no_grad():
        m_lin.out.weight.zero_()
        m_lin.out.bias.zero_()
        m_lin.features.bias.fill_(0.5)
        m_lin.features.dense_linear.weight.fill_(0.25)
    assert torch.allclose(m_lin(b), 0.5 + 0.25 * b.dense.sum(1, keepdim=True))


def test_sync_batch_norm_conversion_keeps_state_and_single_process_output():
    """Converted in place: the same parameter and buffer tensors (so checkpoints and exports
    do not change); outside a distributed run it is BatchNorm1d, in training and eval."""
    from sampan.distributed import SyncBatchNorm, sync_batch_norm_
    from sampan.layers import MLP

    torch.manual_seed(0)
    model = torch.nn.Sequential(MLP(6, [5, 4], batch_norm=True), Dice(4))
    reference = torch.nn.Sequential(MLP(6, [5, 4], batch_norm=True), Dice(4))
    reference.load_state_dict(model.state_dict())
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert sync_batch_norm_(model) == 3
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == 3
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    x = torch.randn(32, 6)
    for train in (True, False):
        model.train(train)
        reference.train(train)
        assert torch.equal(model(x), reference(x))
    for k, v in reference.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_field_pair_weights_learn_at_their_multiple_of_the_dense_rate():
    from sampan.config import TrainConfig
    from sampan.layers.fm import PAIR_WEIGHT_LR
    from sampan.train.compute import dense_optimizer

    pairs, mlp = FieldWeightedFM(4), torch.nn.Linear(3, 1)
    for name in ("adam", "adamw", "sgd"):
        opt = dense_optimizer([*mlp.parameters(), pairs.weight],
                              TrainConfig(optimizer=name, lr=0.002))
        rates = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        assert rates == {id(mlp.weight): 0.002, id(mlp.bias): 0.002,
                         id(pairs.weight): pytest.approx(0.002 * PAIR_WEIGHT_LR)}
