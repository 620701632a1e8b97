"""HSTU (Zhai et al., 2024, "Actions Speak Louder than Words"): hierarchical sequential
transduction units, pointwise aggregated attention in place of softmax attention."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from sampan.config import NextItemConfig
from sampan.layers.sequential import NextItemEncoder
from sampan.models.registry import register_model
from sampan.schema import DataSchema


class HSTUBlock(nn.Module):
    """One unit: ``U, V, Q, K = SiLU(W LayerNorm(x))``; attention weights
    ``SiLU(q.k + rab(i - j)) / max_len`` over the real positions up to each one (no
    softmax: the weights keep how much of the history matters); ``x + W_o (LayerNorm(A V)
    * U)``."""

    def __init__(self, dim: int, heads: int, qk_dim: int, v_dim: int, dropout: float,
                 max_len: int):
        super().__init__()
        self.heads, self.qk_dim, self.v_dim, self.max_len = heads, qk_dim, v_dim, max_len
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, heads * (2 * v_dim + 2 * qk_dim))
        self.norm_attn = nn.LayerNorm(heads * v_dim)
        self.out = nn.Linear(heads * v_dim, dim)
        self.drop = nn.Dropout(dropout)
        # relative position bias, one per head and distance i - j in [0, max_len)
        self.rab = nn.Parameter(torch.zeros(heads, max_len))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor,
                distance: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]``, ``allowed [B, L, L]`` (query i may read key j), ``distance
        [L, L]`` (i - j, clamped at 0) -> ``[B, L, D]``."""
        b, length, _ = x.shape
        h, dqk, dv = self.heads, self.qk_dim, self.v_dim
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split([h * dv, h * dv, h * dqk,
                                                               h * dqk], dim=-1)
        q = q.view(b, length, h, dqk).transpose(1, 2)
        k = k.view(b, length, h, dqk).transpose(1, 2)
        v = v.view(b, length, h, dv).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + self.rab[:, distance]  # [B, h, L, L]
        # a fixed divisor (not the batch's length): a state must not depend on padding
        weights = F.silu(scores) / self.max_len * allowed.unsqueeze(1)
        attn = (weights @ v).transpose(1, 2).reshape(b, length, h * dv)
        return x + self.out(self.drop(self.norm_attn(attn) * u))


@register_model("hstu")
class HSTU(NextItemEncoder):
    """``Batch -> [B, 1]``: the score of the row's item as the next after its history; the
    next-item task trains every position of the history at once and ranks the whole
    catalogue. By default a state scores an item by cosine / temperature, as the reference
    implementation (``meta-recsys/generative-recommenders``) does.

    >>> from sampan.batch import Batch
    >>> from sampan.schema import SequenceFeatureSpec, SparseFeatureSpec
    >>> s = DataSchema(dense=[], sparse=[SparseFeatureSpec("item", 9)],
    ...                sequences=[SequenceFeatureSpec("hist", 4, "item")])
    >>> m = HSTU(s, HSTU.Config(embedding_dim=8, heads=2))
    >>> b = Batch(dense=torch.zeros(2, 0), sparse=torch.tensor([[3], [4]]),
    ...           sequences={"hist": torch.tensor([[0, 0, 2, 5], [6, 7, 8, 2]])})
    >>> m(b).shape, m.user_state(b).shape, m.item_vectors().shape
    (torch.Size([2, 1]), torch.Size([2, 8]), torch.Size([9, 8]))
    """

    class Config(NextItemConfig):
        name: Literal["hstu"] = Field("hstu", description="the model's registered name")
        qk_dim: int | None = Field(None, ge=1, description="query / key width per head; "
                                   "None: embedding_dim / heads")
        v_dim: int | None = Field(None, ge=1, description="value width per head; None: "
                                  "embedding_dim / heads")
        similarity: Literal["dot", "cosine"] = Field(
            "cosine", description="how a state scores an item: cosine / temperature (both "
            "vectors L2-normalised, the reference's choice), or the dot product")

    def __init__(self, schema: DataSchema, cfg: Config):
        if cfg.qk_dim is None or cfg.v_dim is None:
            self.check_heads("hstu", cfg.embedding_dim, cfg.heads)
        super().__init__(schema, cfg, "hstu")
        per_head = cfg.embedding_dim // cfg.heads
        self.units = nn.ModuleList(
            HSTUBlock(cfg.embedding_dim, cfg.heads, cfg.qk_dim or per_head,
                      cfg.v_dim or per_head, cfg.dropout, self.max_len)
            for _ in range(cfg.blocks))
        self.norm = nn.LayerNorm(cfg.embedding_dim)
        idx = torch.arange(self.max_len)
        self.register_buffer("distance", (idx[:, None] - idx[None, :]).clamp_min(0),
                             persistent=False)

    def blocks_forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        distance = self.distance[:length, :length]
        # key j is read by query i when it is real and not later
        allowed = (~pad).unsqueeze(1) & (torch.arange(length, device=x.device)[None, :]
                                         <= torch.arange(length, device=x.device)[:, None])
        allowed = allowed.to(x.dtype)
        for unit in self.units:
            x = unit(x, allowed, distance)
        return self.norm(x)
