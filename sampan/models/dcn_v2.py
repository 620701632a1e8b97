"""DCN-V2 (Wang et al., 2021): explicit feature crosses with full-rank or low-rank matrices,
stacked on or in parallel with an MLP."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import MLPModelConfig
from sampan.layers import MLP, FeatureEmbedding, FieldInput, Linear, bias_terms
from sampan.layers.embed import start_readout_from_lr
from sampan.layers.linear import (
    Choice,
    forward_gemm,
    input_grad_gemm,
    own_gemms,
    plain,
    weight_grad_gemm,
)
from sampan.models.registry import register_model
from sampan.schema import DataSchema


class _CrossNet(torch.autograd.Function):
    """A full-rank cross network's layers in one autograd node, each GEMM on its layer's
    library (:mod:`sampan.layers.linear`). Its backward takes two passes over the
    activations a layer (``g * x_0``, and ``g * (W x_l + b)`` added in place into ``x_0``'s
    gradient) and adds each input gradient inside its GEMM; layer by layer, autograd takes
    four (two products, the sum of the two paths into ``x_l``, the sum into ``x_0``). The
    layers' modules are not called: their forward hooks see nothing while this runs."""

    @staticmethod
    def forward(ctx: Any, x0: torch.Tensor, kernels: list[Choice],
                *params: torch.Tensor) -> torch.Tensor:
        x, saved = x0, []
        for k, w, b in zip(kernels, params[0::2], params[1::2], strict=True):
            wx = forward_gemm(k[0], x, w, b)
            saved += [x, wx]
            x = torch.addcmul(x, x0, wx)
        ctx.save_for_backward(x0, *params, *saved)
        ctx.kernels = kernels
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x0, *rest = ctx.saved_tensors
        n = len(ctx.kernels)
        params, saved = rest[:2 * n], rest[2 * n:]
        grads: list[torch.Tensor | None] = [None] * (2 * n)
        own = False  # g is the caller's (maybe a view of a concatenation's gradient): the
        # first layer's sum of the two paths into x_i makes this node's own copy
        gx0: torch.Tensor | None = None
        for i in reversed(range(n)):  # x_{i+1} = x_i + x_0 * (W_i x_i + b_i)
            k, w, x, wx = ctx.kernels[i], params[2 * i], saved[2 * i], saved[2 * i + 1]
            gwx = g * x0
            gx0 = g * wx if gx0 is None else gx0.addcmul_(g, wx)
            if ctx.needs_input_grad[2 + 2 * i]:
                grads[2 * i] = weight_grad_gemm(k[2], gwx, x)
            if ctx.needs_input_grad[3 + 2 * i]:
                grads[2 * i + 1] = gwx.sum(0)
            if k[1] == "mkl":  # the GEMM adds into g (beta = 1)
                g = g.addmm_(gwx, w) if own else torch.addmm(g, gwx, w)
            else:
                gi = input_grad_gemm(k[1], gwx, w)
                g = g.add_(gi) if own else g + gi
            own = True
        assert gx0 is not None
        return (g.add_(gx0) if ctx.needs_input_grad[0] else None, None, *grads)


class CrossNetV2(nn.Module):
    """``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` for ``layers`` layers; ``[B, d] -> [B, d]``.

    With ``rank`` set, ``W_l = U_l V_l^T`` (the low-rank "DCN-Mix"-free variant of the paper).
    """

    def __init__(self, dim: int, layers: int, rank: int | None = None):
        super().__init__()
        if rank is None:
            self.w = nn.ModuleList(Linear(dim, dim) for _ in range(layers))
        else:
            self.w = nn.ModuleList(nn.Sequential(Linear(dim, rank, bias=False),
                                                 Linear(rank, dim)) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        layers = list(self.w)
        # training only: without gradients the loop below is as fast, and it calls each
        # layer's forward, whose hooks record the shapes the kernel choice times
        if layers and torch.is_grad_enabled() and all(isinstance(w, Linear) for w in layers) \
                and own_gemms(x0, *(w.weight for w in layers)):
            params = [t for w in layers for t in (w.weight, w.bias)]
            return _CrossNet.apply(plain(x0), [w._kernels for w in layers], *params)
        x = x0
        for w in layers:
            x = torch.addcmul(x, x0, w(x))  # x0 * w(x) + x in one pass
        return x

    def start_as_identity(self) -> None:
        """Zero every ``W_l x_l + b_l`` (with ``rank``, only ``V_l`` and ``b_l``: with both
        factors zero neither would get a gradient), so that ``CrossNet(x_0) = x_0`` until
        the crosses learn."""
        with torch.no_grad():
            for w in self.w:
                last = w if isinstance(w, Linear) else w[-1]
                last.weight.zero_()
                last.bias.zero_()


@register_model("dcn_v2")
class DCNv2(nn.Module):
    """``Batch -> [B, T]``. Input ``x_0 = [e_1 .. e_F, dense]`` of width ``F * D + Nd``.

    ``structure: parallel`` concatenates CrossNet(x_0) and MLP(x_0) before the output layer;
    ``stacked`` feeds CrossNet(x_0) into the MLP.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> m = DCNv2(s, DCNv2.Config(embedding_dim=4, mlp=[8], cross_layers=2))
    >>> m(Batch(dense=torch.ones(2, 1), sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    numeric_only = True  # takes numeric features alone (no categorical one)

    class Config(MLPModelConfig):
        name: Literal["dcn_v2"] = Field("dcn_v2", description="the model's registered name")
        cross_layers: int = Field(3, ge=1, description="number of cross layers in the cross "
                                  "network")
        structure: Literal["parallel", "stacked"] = Field(
            "parallel", description="parallel: the output layer reads the cross network and "
            "the MLP side by side, both over the input; stacked: the MLP reads the cross "
            "network's output")
        low_rank: int | None = Field(None, gt=0, description="rank of each cross layer's "
                                     "matrix, factorised as U V^T; None: full rank")
        first_order: bool = Field(
            False, description="add a first-order weight per id and numeric feature to the "
            "output (a wide part, as Wide & Deep's), which the LR warm start fits first (and "
            "keeps frozen); false: the paper's DCN-V2, which the warm start starts as the LR "
            "through its vectors' first column (parallel structure)")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        # with first-order terms the fields' vectors and weights come from one fused lookup
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std,
                                         embed_dense=False) if cfg.first_order else None
        self.input = None if cfg.first_order else \
            FieldInput(schema, cfg.embedding_dim, cfg.embedding_init_std)
        d = schema.num_fields() * cfg.embedding_dim + schema.num_dense
        self.cross = CrossNetV2(d, cfg.cross_layers, cfg.low_rank)
        self.parallel = cfg.structure == "parallel"
        self.mlp = MLP(d, cfg.mlp, dropout=cfg.dropout, batch_norm=cfg.batch_norm)
        self.out = Linear(d + self.mlp.out_dim if self.parallel else self.mlp.out_dim,
                             schema.num_tasks)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias if self.features is not None else self.out.bias)

    def lr_input(self) -> FieldInput | None:
        """What an LR warm start fills (:func:`~sampan.layers.embed.lr_start_part`): with
        the parallel structure, the field vectors, whose first columns take the LR's id
        weights while the output layer reads them through a cross network that starts as the
        identity. ``None`` with ``first_order`` (its own first-order terms take the LR), with
        the stacked structure (an MLP between the vectors and the output) or vectors
        narrower than the tasks."""
        if self.input is None or not self.parallel or \
                self.input.dim < self.out.weight.shape[0]:
            return None
        return self.input

    def start_from_lr(self, bias: torch.Tensor, dense_weight: torch.Tensor | None) -> None:
        """Make the model the LR whose id weights :func:`lr_input`'s vectors now hold: the
        crosses start at zero, the output layer reads the LR (the MLP's part of it at zero)."""
        self.cross.start_as_identity()
        start_readout_from_lr(self.input, self.out, bias, dense_weight)

    def forward(self, batch: Batch) -> torch.Tensor:
        wide = None
        if self.features is not None:
            wide, v = self.features(batch)
            x0 = torch.cat([v.flatten(1), batch.dense], dim=1)
        else:
            x0 = self.input(batch)
        if self.parallel:
            out = self.out(torch.cat([self.cross(x0), self.mlp(x0)], dim=1))
        else:
            out = self.out(self.mlp(self.cross(x0)))
        return out if wide is None else out + wide
