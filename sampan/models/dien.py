"""DIEN (Zhou et al., 2019): interest extraction with a GRU, interest evolution with an
attention-gated GRU (AUGRU), and an auxiliary loss that makes each interest state predict the
next behaviour."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.embedding import EmbeddingCollection
from sampan.layers import MLP, TargetAttention, embed_fields
from sampan.models.registry import register_model
from sampan.schema import DataSchema


def right_align(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Left-padded ``[B, L, ...]`` -> the same rows with the real events first."""
    L = x.shape[1]
    idx = (torch.arange(L, device=x.device) + (L - lengths).unsqueeze(1)) % L  # [B, L]
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x))


class AUGRU(nn.Module):
    """GRU whose update gate is scaled by an attention weight: ``u' = a_t * u_t``.

    Runs over right-aligned ``x [B, L, H]`` with weights ``a [B, L]`` and ``mask [B, L]``;
    padded steps keep the state, so the result is the state after each row's last event.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.x_proj = nn.Linear(dim, 3 * dim)
        self.h_proj = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x: torch.Tensor, a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gx = self.x_proj(x)  # all steps at once; only the recurrent part loops
        h = x.new_zeros(x.shape[0], x.shape[2])
        for t in range(x.shape[1]):
            xr, xu, xn = gx[:, t].chunk(3, dim=-1)
            hr, hu, hn = self.h_proj(h).chunk(3, dim=-1)
            r = torch.sigmoid(xr + hr)
            u = torch.sigmoid(xu + hu) * a[:, t: t + 1]
            n = torch.tanh(xn + r * hn)
            new = (1 - u) * h + u * n
            h = torch.where(mask[:, t: t + 1], new, h)
        return h


@register_model("dien")
class DIEN(nn.Module):
    """``Batch -> [B, T]``: MLP over ``[e_1 .. e_F', evolved interest, sum of the history,
    that sum times the target, dense]`` (the last two as in the authors' implementation).

    ``target`` and ``history`` resolve as in DIN. In training, :meth:`forward_with_aux` also
    returns the auxiliary loss (next-behaviour prediction against in-batch negatives,
    weighted by ``aux_loss_weight``), which the task adds to its loss; ``forward`` is the
    scoring graph.
    """

    class Config(ModelConfig):
        name: Literal["dien"] = Field("dien", description="the model's registered name")
        target: str | None = Field(None, description="the sparse feature of the candidate item; "
                                   "None: the feature whose ids the history holds")
        history: str | None = Field(None, description="the behaviour sequence (a `kind: sequence` "
                                    "list) the GRUs read; None: the data's only one")
        attention_mlp: list[int] = Field(default_factory=lambda: [80, 40],
                                         description="hidden layer sizes of the attention MLP "
                                         "(ReLU) that scores each interest state against the "
                                         "target")
        aux_mlp: list[int] = Field(default_factory=lambda: [32],
                                   description="hidden layer sizes of the auxiliary MLP that "
                                   "tells each next event from an in-batch one")
        aux_loss_weight: float = Field(1.0, ge=0.0, description="weight of the auxiliary "
                                       "next-behaviour loss added to the training loss; 0: off")
        mlp: list[int] = Field(default_factory=lambda: [200, 80],
                               description="the output MLP's hidden layer sizes, first to last")
        activation: Literal["dice", "prelu", "relu"] = Field(
            "dice", description="activation of the output MLP's hidden layers")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability after "
                               "each hidden layer of the output MLP; 0: none")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.history, self.target_idx = schema.history_and_target("dien", cfg.history,
                                                                  cfg.target)
        self.schema = schema
        self.aux_weight = cfg.aux_loss_weight
        d = cfg.embedding_dim
        self.embedding = EmbeddingCollection(schema.tables(d), cfg.embedding_init_std)
        self.extractor = nn.GRU(d, d, batch_first=True)
        self.attention = TargetAttention(d, cfg.attention_mlp, "relu")
        self.evolution = AUGRU(d)
        self.aux = MLP(2 * d, cfg.aux_mlp, out=1, act="relu")
        self.mlp = MLP((schema.num_fields() + 2) * d + schema.num_dense, cfg.mlp,
                       out=schema.num_tasks, dropout=cfg.dropout, act=cfg.activation)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return self.mlp.output_bias()

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.forward_with_aux(batch)[0]

    def forward_with_aux(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits [B, 1], auxiliary loss)``: the loss only in training with
        ``aux_loss_weight > 0`` (see :mod:`sampan.tasks.base`)."""
        e, hist = embed_fields(self.embedding, batch, self.schema, attend=(self.history,))
        lengths = batch.lengths(self.history)
        x = right_align(hist[self.history], lengths)  # [B, L, D], real events first
        L = x.shape[1]
        mask = torch.arange(L, device=x.device) < lengths.unsqueeze(1)
        # Right-aligned, a state at a real position depends only on earlier real events, so
        # no packing is needed (states past a row's end are masked below); this also keeps
        # the graph free of host syncs and exportable.
        states, _ = self.extractor(x)
        target = e[:, self.target_idx]
        a = self.attention(target, states, mask)
        interest = self.evolution(states, a, mask)
        aux = self.aux_weight * self._aux_loss(states, x, mask) \
            if self.training and self.aux_weight > 0 else None
        # as in the authors' code: the history sum and its product with the target join the
        # evolved interest
        hist_sum = (x * mask.unsqueeze(-1).to(x.dtype)).sum(dim=1)
        return self.mlp(torch.cat([e.flatten(1), interest, hist_sum, hist_sum * target,
                                   batch.dense], dim=1)), aux

    def _aux_loss(self, states: torch.Tensor, x: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """State ``h_t`` tells the next event ``e_{t+1}`` from a random in-batch event."""
        valid = mask[:, 1:]  # pairs (t, t + 1) with both real
        if not bool(valid.any()):
            return states.sum() * 0.0
        h = states[:, :-1][valid]
        pos = x[:, 1:][valid]
        pool = x[mask]
        # index_select, not pool[idx]: the backward of advanced indexing accumulates
        # repeated rows in a thread-dependent order on CPU (not bit-reproducible)
        neg = pool.index_select(0, torch.randint(0, len(pool), (len(pos),), device=x.device))
        logits = self.aux(torch.cat([torch.cat([h, pos], 1), torch.cat([h, neg], 1)]))
        target = torch.cat([torch.ones(len(pos), 1), torch.zeros(len(neg), 1)]).to(logits)
        return F.binary_cross_entropy_with_logits(logits.float(), target.float())
