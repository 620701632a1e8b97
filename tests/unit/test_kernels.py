"""Kernel choice by measurement (issue 14): the faster path per layer shape, with injected
timings; the cache, its re-check, forced modes, and that a run keeps its choice."""

from __future__ import annotations

import json

import pytest
import torch

from sampan.layers import MLP
from sampan.layers.kernels import KernelPlan, apply, choose, layer_shapes, plan_kernels
from sampan.layers.linear import Linear, onednn_available


class FakeTimer:
    """oneDNN wins on wide layers, MKL on narrow ones; counts calls."""

    def __init__(self, flip: bool = False):
        self.calls, self.flip = 0, flip

    def __call__(self, kernel, shape):
        self.calls += 1
        n, k, o = shape
        wide = k * o >= 400 * 400
        onednn_faster = wide != self.flip
        return 1.0 if (kernel == "onednn") == onednn_faster else 1.3


def test_choose_picks_the_faster_kernel_per_shape_and_caches(tmp_path):
    cache = tmp_path / "kernels.json"
    shapes = [(4096, 429, 400), (4096, 400, 400), (4096, 400, 1)]
    t = FakeTimer()
    best, times, source = choose(shapes, t, cache, machine="cpu-A")
    assert best == {"4096x429x400": "onednn", "4096x400x400": "onednn", "4096x400x1": "mkl"}
    assert source == "measured" and t.calls == 6
    assert set(json.loads(cache.read_text())) == {"cpu-A"}
    t2 = FakeTimer()
    best2, _, source = choose(shapes, t2, cache, machine="cpu-A")
    assert best2 == best and source == "cached" and t2.calls == 2  # the largest re-checked
    t3 = FakeTimer()
    choose(shapes, t3, cache, machine="cpu-B")  # another CPU / torch / thread count
    assert t3.calls == 6 and set(json.loads(cache.read_text())) == {"cpu-A", "cpu-B"}


def test_a_cache_the_machine_no_longer_matches_is_measured_again(tmp_path):
    cache = tmp_path / "kernels.json"
    shapes = [(1024, 512, 512), (1024, 512, 8)]
    choose(shapes, FakeTimer(), cache, machine="m")
    flipped = FakeTimer(flip=True)
    best, _, source = choose(shapes, flipped, cache, machine="m")
    assert source == "measured" and flipped.calls == 2 + 4
    assert best == {"1024x512x512": "mkl", "1024x512x8": "onednn"}


def test_plan_kernels_records_shapes_and_applies_the_choice(tmp_path):
    mlp = MLP(429, [400, 400], out=1)
    x = torch.randn(64, 429)
    rng = torch.get_rng_state()
    shapes = layer_shapes(mlp, lambda: mlp(x))
    assert torch.equal(rng, torch.get_rng_state())  # the probe draws nothing
    assert sorted(shapes.values()) == [(64, 400, 1), (64, 400, 400), (64, 429, 400)]
    plan = plan_kernels(mlp, "auto", lambda: mlp(x), FakeTimer(), tmp_path / "k.json")
    if not onednn_available():
        assert set(plan.layers.values()) == {"mkl"}
        return
    kinds = {m.out_features: m.kernel for m in mlp.modules() if isinstance(m, Linear)}
    assert kinds == {400: "onednn", 1: "mkl"}
    assert "mkl for 1 layer(s), onednn for 2 layer(s) (measured: 64x429x400 onednn 1.30x" \
        in plan.describe()
    forced = plan_kernels(mlp, "mkl", lambda: mlp(x))
    assert {m.kernel for m in mlp.modules() if isinstance(m, Linear)} == {"mkl"}
    assert "train.kernels=mkl" in forced.describe()
    again = KernelPlan.from_json(json.loads(json.dumps(plan.to_json())))
    apply(mlp, again)  # what a resumed run does with the run's kernels.json
    assert {m.out_features: m.kernel for m in mlp.modules() if isinstance(m, Linear)} == kinds


@pytest.mark.parametrize("kernel", ["mkl", "onednn"])
def test_both_kernels_compute_the_same_layer(kernel):
    if kernel == "onednn" and not onednn_available():
        pytest.skip("no oneDNN in this torch build")
    layer = Linear(30, 7)
    layer.kernel = kernel
    x = torch.randn(50, 30, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
