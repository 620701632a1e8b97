"""Linear layer whose three CPU matrix multiplies each run on the faster library.

A linear layer's training step is three GEMMs: the forward ``x W^T``, the input gradient
``g W`` and the weight gradient ``g^T x``. PyTorch's CPU ``addmm`` sends all three to MKL,
which on non-Intel x86 CPUs (e.g. AMD EPYC) runs its AVX2 code path; oneDNN's fp32 GEMM uses
AVX-512 there and is about 2x faster for the MLP shapes of CTR models (measured: 200 vs 490
GFLOP/s at 4096 x 400 x 400 on 2 EPYC cores). On an AVX2-only CPU the two are close, and
which one wins differs between the three GEMMs of one layer (oneDNN's weight gradient needs
a transposed copy of an operand; at DIN's attention shapes, 204,800 rows, MKL's is twice as
fast). So each layer carries one library per GEMM (``kernel``, chosen by measurement in
:mod:`sampan.layers.kernels`), and an MLP's ReLU runs inside the forward GEMM (oneDNN's
post-op, or in place after MKL's) instead of as a pass of its own over the activations.

Numerics stay fp32 (only the summation order differs between libraries). Anything else
(CUDA, autocast, other dtypes, compiled or exported graphs) uses
``torch.nn.functional.linear`` (and ``relu``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sampan import native

KERNELS = ("mkl", "onednn")
GEMMS = ("forward", "input_grad", "weight_grad")
Choice = tuple[str, str, str]  # the library of each of GEMMS
ALL_MKL: Choice = ("mkl", "mkl", "mkl")


def parse_kernel(spec: str) -> Choice:
    """``"onednn"`` (one library for all three GEMMs) or ``"onednn/onednn/mkl"`` (forward /
    input gradient / weight gradient) -> a choice tuple.

    >>> parse_kernel("mkl"), parse_kernel("onednn/mkl/mkl")
    (('mkl', 'mkl', 'mkl'), ('onednn', 'mkl', 'mkl'))
    """
    parts = spec.split("/")
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or any(p not in KERNELS for p in parts):
        raise ValueError(f"kernel {spec!r}: expected one of {KERNELS}, or three of them "
                         "joined by '/' (forward/input_grad/weight_grad)")
    return (parts[0], parts[1], parts[2])


def kernel_name(choice: Choice) -> str:
    """The inverse of :func:`parse_kernel` (one name when the three agree)."""
    return choice[0] if len(set(choice)) == 1 else "/".join(choice)


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


def _gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
          post: str = "none") -> torch.Tensor:
    """``x [N, K] @ w[O, K]^T (+ b)`` on oneDNN, with ``post`` ("none" or "relu") applied
    in the GEMM's epilogue; strided (transposed) views are fine."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, post, [], "")


def _native_grads() -> bool:
    return native.library() is not None


def _transposed(a: torch.Tensor) -> torch.Tensor:
    """``a.t().contiguous()``: by the C kernel where it is built (one tiled pass), else
    copied in row blocks that stay in cache (about 3x faster than one strided copy for
    activations of CTR MLPs)."""
    if a.dtype == torch.float32 and a.dim() == 2 and _native_grads():
        a = a.contiguous()
        out = a.new_empty(a.shape[1], a.shape[0])
        native.dense_grad(a, None, None, out, None)
        return out
    n = a.shape[0]
    if n <= 1024:
        return a.t().contiguous()
    out = torch.empty(a.shape[1], n, dtype=a.dtype)
    for i in range(0, n, 512):
        out[:, i:i + 512] = a[i:i + 512].t()
    return out


def plain(a: torch.Tensor) -> torch.Tensor:
    """``a`` itself when it is row- or column-major (a transpose is free to every GEMM
    here), else a contiguous copy. oneDNN runs a GEMM on any other layout, such as a view of
    some columns of a wider tensor, on a reference path about 1,000x slower (measured: the
    weight gradient of a 106,496 x 16 input 534 ms, against 6 ms contiguous), and the kernel
    choice times contiguous operands."""
    if a.dim() != 2 or a.is_contiguous() or a.t().is_contiguous():
        return a
    return a.contiguous()


def forward_gemm(kernel: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 relu: bool = False) -> torch.Tensor:
    """``x [N, K] W^T (+ b)`` (then ReLU) on ``kernel``'s library."""
    if kernel == "onednn":
        return _gemm(x, w, b, "relu" if relu else "none")
    out = torch.addmm(b, x, w.t()) if b is not None else x.mm(w.t())
    return out.relu_() if relu else out


def input_grad_gemm(kernel: str, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``g [N, O] W [O, K]``: the gradient of the layer's input. With one output it is an
    outer product, one broadcast multiply (the same products, each written once: both
    libraries' GEMMs took longer for it)."""
    if w.shape[0] == 1:
        return g * w
    return _gemm(g, w.t(), None) if kernel == "onednn" else g.mm(w)


def weight_grad_gemm(kernel: str, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g^T [O, N] x [N, K]``: the gradient of the weight. MKL takes the transposed operand
    as a flag; oneDNN needs it copied (in cache-sized blocks)."""
    return _gemm(_transposed(g), x.t(), None) if kernel == "onednn" else g.t().mm(x)


def own_gemms(*tensors: torch.Tensor) -> bool:
    """Whether a layer on these tensors runs its own GEMMs (:func:`forward_gemm` and the
    others): fp32 on the CPU, outside autocast, where this torch has oneDNN. Compiled,
    exported and traced graphs use the standard ops (inductor lowers them; it has no
    lowering of the oneDNN call)."""
    return (_ONEDNN and all(t.device.type == "cpu" and t.dtype == torch.float32
                            for t in tensors)
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


class _Linear(torch.autograd.Function):
    """A linear layer (and a fused ReLU) whose three GEMMs run on the libraries of
    ``kernels`` (see :data:`GEMMS`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                kernels: Choice, relu: bool) -> torch.Tensor:
        out = forward_gemm(kernels[0], x, w, b, relu)
        # with the ReLU fused its output is saved (its mask is the ReLU's gradient): the
        # next layer keeps it as its input anyway, so this costs no memory
        ctx.save_for_backward(x, w, out if relu else None)
        ctx.has_bias, ctx.kernels, ctx.relu = b is not None, kernels, relu
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, y = ctx.saved_tensors
        _, gx_kernel, gw_kernel = ctx.kernels
        want_gb = ctx.has_bias and ctx.needs_input_grad[2]
        gb = gt = None
        if g.dtype == torch.float32 and _native_grads():
            # one C pass: the ReLU's backward, the bias's gradient and the transposed copy
            # oneDNN's weight gradient reads
            g = g.contiguous()
            relu_g = torch.empty_like(g) if ctx.relu else None
            if gw_kernel == "onednn" and ctx.needs_input_grad[1]:
                gt = g.new_empty(g.shape[1], g.shape[0])
            gb = g.new_empty(g.shape[1]) if want_gb else None
            if relu_g is not None or gt is not None or gb is not None:
                native.dense_grad(g, y, relu_g, gt, gb)
            g = g if relu_g is None else relu_g
        else:
            # the ReLU's backward is one pass that also makes the gradient contiguous
            g = torch.ops.aten.threshold_backward(g, y, 0.0) if ctx.relu else g.contiguous()
            gb = g.sum(0) if want_gb else None
        gx = input_grad_gemm(gx_kernel, g, w) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = _gemm(gt, x.t(), None) if gt is not None else weight_grad_gemm(gw_kernel, g, x)
        return gx, gw, gb, None, None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kernels: Choice,
           relu: bool = False) -> torch.Tensor:
    """``F.linear`` (then ReLU) of ``x [..., K]`` with each GEMM on its library."""
    lead = x.shape[:-1]
    out = _Linear.apply(plain(x.reshape(-1, x.shape[-1])), plain(w), b, kernels, relu)
    return out.reshape(*lead, w.shape[0])


class Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters and state_dict) with a CPU library per GEMM.

    ``kernel`` is ``"onednn"`` (the default), ``"mkl"`` (``F.linear``, exactly
    ``nn.Linear``; a layer with one output computes the same numbers with its input
    gradient as a broadcast multiply), or one library per GEMM such as
    ``"onednn/onednn/mkl"`` (forward / input gradient / weight gradient); training sets it
    per layer by measurement (:mod:`sampan.layers.kernels`, ``train.kernels``).
    ``activation="relu"`` applies a ReLU to the output inside the forward GEMM (what
    :class:`~sampan.layers.mlp.MLP` uses).

    >>> layer = Linear(3, 2)
    >>> x = torch.randn(5, 3)
    >>> torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-6)
    True
    >>> layer.kernel = "onednn/mkl/mkl"; layer.kernel
    'onednn/mkl/mkl'
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 activation: str | None = None, device: Any = None, dtype: Any = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if activation not in (None, "relu"):
            raise ValueError(f"Linear activation must be None or 'relu', got {activation!r}")
        self.relu = activation == "relu"
        self._kernels: Choice = ("onednn",) * 3

    @property
    def kernel(self) -> str:
        return kernel_name(self._kernels)

    @kernel.setter
    def kernel(self, spec: str) -> None:
        self._kernels = parse_kernel(spec)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., O]``; ``weight`` (``[O, K]``, computed from
        ``self.weight`` by the caller) replaces the layer's own, bias and kernels kept."""
        w = self.weight if weight is None else weight
        if ((self._kernels != ALL_MKL or self.out_features == 1)  # (see input_grad_gemm)
                and own_gemms(x, w)):
            return linear(x, w, self.bias, self._kernels, self.relu)
        out = F.linear(x, w, self.bias)
        return F.relu(out) if self.relu else out

    def extra_repr(self) -> str:
        return super().extra_repr() + (", activation=relu" if self.relu else "")
