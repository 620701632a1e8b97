"""The oneDNN Linear path computes what nn.Linear computes (values and gradients)."""

import pytest
import torch
import torch.nn.functional as F

from sampan import native
from sampan.layers.linear import Linear, _transposed, onednn_available
from sampan.train.trainer import compile_dense


@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 5), (2048, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_functional_linear(shape, bias):
    torch.manual_seed(0)
    layer = Linear(5, 6, bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    out = layer(x)
    g = torch.randn_like(out)
    out.backward(g)
    got = (out.detach(), x.grad.clone(), layer.weight.grad.clone(),
           None if not bias else layer.bias.grad.clone())
    x.grad = None
    layer.zero_grad()
    ref = F.linear(x, layer.weight, layer.bias)
    ref.backward(g)
    want = (ref.detach(), x.grad, layer.weight.grad, None if not bias else layer.bias.grad)
    for a, b in zip(got, want, strict=True):
        if b is not None:
            # fp32 sums over up to 2048 rows in another order: relative error ~1e-6
            scale = b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6 * max(scale, 1.0))


def _graph_nodes(fn):
    """Names of every autograd node behind ``fn``."""
    seen, todo = [], [fn]
    while todo:
        f = todo.pop()
        if f is not None:
            seen.append(type(f).__name__)
            todo.extend(g for g, _ in f.next_functions)
    return seen


def test_onednn_path_is_taken_when_available():
    # On x86 builds of torch the fast path exists; elsewhere the fallback must be used.
    layer = Linear(4, 3)
    x = torch.randn(8, 4, requires_grad=True)
    nodes = _graph_nodes(layer(x).grad_fn)
    assert any(n.startswith("_LinearBackward") for n in nodes) == onednn_available(), nodes
    layer.kernel = "mkl"  # what train.kernels chooses where MKL is faster
    nodes = _graph_nodes(layer(x).grad_fn)
    assert not any(n.startswith("_Linear") for n in nodes) and \
        any(n.startswith("Addmm") for n in nodes)


@pytest.mark.parametrize("kernel", ["mkl", "onednn", "mkl/onednn/mkl"])
def test_one_output_layer_gradients_are_nn_linears_to_the_bit(kernel):
    """A layer with one output takes its input gradient as a broadcast multiply (an outer
    product: no sum, so the same numbers as the GEMM), whatever its kernel."""
    torch.manual_seed(0)
    layer = Linear(37, 1)
    layer.kernel = kernel
    x = torch.randn(300, 37, requires_grad=True)
    out = layer(x)
    assert any(n.startswith("_LinearBackward") for n in _graph_nodes(out.grad_fn)) == \
        onednn_available()
    g = torch.randn_like(out)
    out.backward(g)
    gx = x.grad.clone()
    x.grad = None
    F.linear(x, layer.weight, layer.bias).backward(g)
    assert torch.equal(gx, x.grad)


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN GEMM")
def test_gemms_get_row_or_column_major_operands_only(monkeypatch):
    """oneDNN runs any other layout on a reference path ~1,000x slower: a layer fed a view
    of some columns (FiBiNET's field vectors are such a view of the fused lookup) or given a
    strided weight copies it first, with the values and gradients of F.linear."""
    import sampan.layers.linear as lin

    seen = []

    def gemm(x, w, b, post="none"):
        seen.append(all(t.is_contiguous() or t.t().is_contiguous() for t in (x, w)))
        return torch.ops.mkldnn._linear_pointwise(x, w, b, post, [], "")

    monkeypatch.setattr(lin, "_gemm", gemm)
    torch.manual_seed(0)
    layer = Linear(8, 6)
    wide = torch.randn(4, 5, 9, requires_grad=True)
    x = wide[..., :8]  # rows 9 floats apart
    for weight in (None, torch.randn(6, 10)[:, 1:9]):
        out = layer(x, weight)
        out.backward(torch.ones_like(out))
        ref = F.linear(x, layer.weight if weight is None else weight, layer.bias)
        torch.testing.assert_close(out, ref)
    assert seen and all(seen), seen
    assert wide.grad is not None and wide.grad[..., 8].abs().sum() == 0


@pytest.mark.parametrize("c_kernels", [True, False], ids=["c", "tensor-ops"])
def test_blocked_transpose(c_kernels, monkeypatch):
    import sampan.layers.linear as lin

    monkeypatch.setattr(lin, "_native_grads", lambda: c_kernels and native.library() is not None)
    a = torch.randn(3000, 37)
    assert torch.equal(_transposed(a), a.t().contiguous())


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN GEMM")
@pytest.mark.parametrize("kernel", ["onednn", "onednn/onednn/mkl", "mkl/mkl/onednn"])
@pytest.mark.parametrize("relu", [True, False])
def test_the_c_backward_pass_gives_the_gradients_of_the_tensor_path(kernel, relu,
                                                                    monkeypatch):
    """The C pass (the ReLU's backward, the bias's gradient and the transposed copy in one)
    against threshold_backward, sum and the blocked copy: the same input and weight
    gradients to the bit (the GEMMs read the same numbers), the bias's within fp32
    rounding; shapes that are not whole tiles, and outputs exactly 0 (the ReLU's edge)."""
    import sampan.layers.linear as lin

    if native.library() is None:
        pytest.skip(f"the C kernels: {native.status()}")
    torch.manual_seed(0)
    layer = Linear(45, 37, activation="relu" if relu else None)
    layer.kernel = kernel
    x = torch.randn(1003, 45)
    x[:5] = 0.0
    with torch.no_grad():
        layer.bias[:3] = 0.0  # rows of zeros: outputs exactly 0 in those columns
    up = torch.randn(1003, 37)

    def grads(c_kernels: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(lin, "_native_grads", lambda: c_kernels)
        xi = x.clone().requires_grad_()
        layer.zero_grad()
        layer(xi).backward(up)
        return [xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]

    (gx, gw, gb), (rx, rw, rb) = grads(True), grads(False)
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
    torch.testing.assert_close(gb, rb, rtol=1e-5, atol=1e-5)


def test_autocast_falls_back_to_functional_linear():
    layer = Linear(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


def test_state_dict_is_nn_linear_compatible():
    layer = Linear(4, 3)
    plain = torch.nn.Linear(4, 3)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(5, 4)
    torch.testing.assert_close(plain(x), layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_dense_keeps_results_and_state_dict_keys():
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec
    from sampan.testing import batch

    schema = DataSchema(dense=["x1", "x2"],
                        sparse=[SparseFeatureSpec("a", 6), SparseFeatureSpec("b", 4),
                                SparseFeatureSpec("c", 9)],
                        sequences=[SequenceFeatureSpec("hist_c", 5, "c")])
    torch.manual_seed(0)
    model = build_model(get_model_class("din").Config(embedding_dim=4, mlp=[8]), schema).eval()
    keys = list(model.state_dict())
    with torch.no_grad():
        want = model(batch())
    compile_dense(model)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(batch()), want, rtol=1e-4, atol=1e-5)
