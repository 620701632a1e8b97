"""Linear layer whose CPU matrix multiplies can run on oneDNN.

PyTorch's CPU ``addmm`` goes to MKL, which on non-Intel x86 CPUs (e.g. AMD EPYC) runs its
AVX2 code path; oneDNN's fp32 GEMM uses AVX-512 there and is about 2x faster for the MLP
shapes of CTR models (measured: 200 vs 490 GFLOP/s at 4096 x 400 x 400 on 2 EPYC cores).
Forward, input gradient and weight gradient all go through ``mkldnn._linear_pointwise``.
Numerics stay fp32 (only the summation order differs). Anything else (CUDA, autocast,
other dtypes, builds without oneDNN) uses ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def onednn_available() -> bool:
    """True when this torch build can run fp32 GEMMs on oneDNN (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 3.0)))


_ONEDNN = onednn_available()  # probed once at import (keeps the check out of compiled graphs)


def _gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x [N, K] @ w[O, K]^T (+ b)`` on oneDNN; strided (transposed) views are fine."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _transposed(a: torch.Tensor) -> torch.Tensor:
    """``a.t().contiguous()``, copied in row blocks that stay in cache (about 3x faster than
    one strided copy for activations of CTR MLPs)."""
    n = a.shape[0]
    if n <= 1024:
        return a.t().contiguous()
    out = torch.empty(a.shape[1], n, dtype=a.dtype)
    for i in range(0, n, 512):
        out[:, i:i + 512] = a[i:i + 512].t()
    return out


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _gemm(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        g = g.contiguous()
        gx = _gemm(g, w.t(), None) if ctx.needs_input_grad[0] else None
        gw = _gemm(_transposed(g), x.t(), None) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters and state_dict) with the oneDNN CPU path.

    ``kernel`` is ``"onednn"`` (the default) or ``"mkl"`` (``F.linear``); training sets it
    per layer by measurement (:mod:`sampan.layers.kernels`, ``train.kernels``).

    >>> layer = Linear(3, 2)
    >>> x = torch.randn(5, 3)
    >>> torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-6)
    True
    """

    kernel = "onednn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.kernel == "onednn" and x.device.type == "cpu" and x.dtype == torch.float32
                and self.weight.dtype == torch.float32
                and not torch.is_autocast_enabled("cpu") and _ONEDNN
                # compiled, exported and traced graphs use the standard op (inductor
                # lowers it; it has no lowering of the oneDNN call)
                and not torch.compiler.is_compiling() and not torch.jit.is_tracing()):
            return _onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    out = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), w, b)
    return out.reshape(*lead, w.shape[0])
