"""ESMM (Ma et al., 2018): CVR learned over the entire impression space through
pCTCVR = pCTR * pCVR, so the conversion tower never trains on clicked rows only."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.errors import ConfigError
from sampan.layers import MLP, FieldInput
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("esmm")
class ESMM(nn.Module):
    """``Batch -> [B, 2]``: the logits of pCTR and of pCTCVR = pCTR * pCVR.

    The labels are ``[click, click_and_convert]`` (in that order), both defined on every
    impression; the pCVR of a row is ``sigmoid(cvr_logit)`` from :meth:`cvr`.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5)], labels=["click", "buy"])
    >>> ESMM(s, ESMM.Config(embedding_dim=4, tower_mlp=[8]))(Batch(
    ...     dense=torch.ones(3, 1), sparse=torch.ones(3, 1, dtype=torch.long))).shape
    torch.Size([3, 2])
    """

    tasks = 2  # the number of labels the model needs (contract tests read it)

    numeric_only = True  # takes numeric features alone (no categorical one)

    class Config(ModelConfig):
        name: Literal["esmm"] = Field("esmm", description="the model's registered name")
        tower_mlp: list[int] = Field(default_factory=lambda: [256, 128],
                                     description="hidden layer sizes of each of the CTR and CVR "
                                     "towers, first to last")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability after "
                               "each hidden layer of the towers; 0: none")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        if schema.num_tasks != 2:
            raise ConfigError("esmm needs two labels, [click, click_and_convert]; got "
                             f"{schema.labels}")
        self.input = FieldInput(schema, cfg.embedding_dim, cfg.embedding_init_std)
        self.ctr = MLP(self.input.out_dim, cfg.tower_mlp, out=1, dropout=cfg.dropout)
        self.cvr_tower = MLP(self.input.out_dim, cfg.tower_mlp, out=1, dropout=cfg.dropout)

    def cvr(self, batch: Batch) -> torch.Tensor:
        """Logit of pCVR ``[B, 1]`` (conversion given a click)."""
        return self.cvr_tower(self.input(batch))

    def forward(self, batch: Batch) -> torch.Tensor:
        x = self.input(batch)
        ctr, cvr = self.ctr(x), self.cvr_tower(x)
        # log pCTCVR = log pCTR + log pCVR; its logit, kept finite for BCE-with-logits
        log_p = F.logsigmoid(ctr) + F.logsigmoid(cvr)
        log_1mp = torch.log(-torch.expm1(log_p).clamp(max=-1e-7))
        return torch.cat([ctr, log_p - log_1mp], dim=1)
