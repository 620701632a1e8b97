"""SASRec (Kang & McAuley, 2018): a causal transformer over the user's item history that
predicts the next item from the whole catalogue."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.config import NextItemConfig
from sampan.layers.sequential import NextItemEncoder
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("sasrec")
class SASRec(NextItemEncoder):
    """``Batch -> [B, 1]``: the score of the row's item as the next after its history,
    ``<state(history), e_item>``; the next-item task trains every position of the history
    at once and ranks the whole catalogue. Blocks: pre-norm self-attention (softmax over
    the real items up to each position) and a GELU feed-forward layer, then a final norm.

    >>> from sampan.batch import Batch
    >>> from sampan.schema import SequenceFeatureSpec, SparseFeatureSpec
    >>> s = DataSchema(dense=[], sparse=[SparseFeatureSpec("item", 9)],
    ...                sequences=[SequenceFeatureSpec("hist", 4, "item")])
    >>> m = SASRec(s, SASRec.Config(embedding_dim=8, heads=2))
    >>> b = Batch(dense=torch.zeros(2, 0), sparse=torch.tensor([[3], [4]]),
    ...           sequences={"hist": torch.tensor([[0, 0, 2, 5], [6, 7, 8, 2]])})
    >>> m(b).shape, m.user_state(b).shape, m.item_vectors().shape
    (torch.Size([2, 1]), torch.Size([2, 8]), torch.Size([9, 8]))
    """

    class Config(NextItemConfig):
        name: Literal["sasrec"] = Field("sasrec", description="the model's registered name")
        ffn_mult: int = Field(1, ge=1, description="the feed-forward layer's width, in "
                              "multiples of embedding_dim (1 in the paper)")

    def __init__(self, schema: DataSchema, cfg: Config):
        self.check_heads("sasrec", cfg.embedding_dim, cfg.heads)
        super().__init__(schema, cfg, "sasrec")
        d = cfg.embedding_dim
        layer = nn.TransformerEncoderLayer(d, cfg.heads, d * cfg.ffn_mult, cfg.dropout,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("causal", torch.triu(torch.ones(self.max_len, self.max_len,
                                                             dtype=torch.bool), 1),
                             persistent=False)
        self.register_buffer("eye", torch.eye(self.max_len, dtype=torch.bool),
                             persistent=False)

    def blocks_forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        # no later position and no padding, but always itself: a padding position (and a
        # row with no history at all) attends to itself rather than to nothing, which would
        # be NaN and reach real positions through the next layer's weights
        mask = (self.causal[:length, :length].unsqueeze(0) | pad.unsqueeze(1)) & \
            ~self.eye[:length, :length]
        # [B * heads, L, L], the batch kept symbolic for export (repeat_interleave fixes it)
        mask = mask.unsqueeze(1).expand(-1, self.heads, -1, -1).reshape(-1, length, length)
        # is_causal given: the mask also hides padding (and torch would otherwise compare
        # its shape with the sequence length, which fixes the batch size of an export)
        return self.norm(self.encoder(x, mask=mask, is_causal=False))
