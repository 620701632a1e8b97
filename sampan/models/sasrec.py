"""SASRec (Kang & McAuley, 2018): a causal transformer over the user's item history that
predicts the next item from the whole catalogue."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.embedding import EmbeddingCollection
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("sasrec")
class SASRec(nn.Module):
    """``Batch -> [B, 1]``: the score of the row's item (``target``) as the next item after
    its history, ``<state(history), e_item>``; the next-item task trains every position of
    the history at once and ranks the whole catalogue with :meth:`user_state` and
    :meth:`item_vectors`.

    The item embeddings are the rows of the target's table, shared by the history (the
    history must ``share`` the target's vocabulary); they are the output layer too.

    >>> from sampan.schema import SequenceFeatureSpec, SparseFeatureSpec
    >>> s = DataSchema(dense=[], sparse=[SparseFeatureSpec("item", 9)],
    ...                sequences=[SequenceFeatureSpec("hist", 4, "item")])
    >>> m = SASRec(s, SASRec.Config(embedding_dim=8, heads=2))
    >>> b = Batch(dense=torch.zeros(2, 0), sparse=torch.tensor([[3], [4]]),
    ...           sequences={"hist": torch.tensor([[0, 0, 2, 5], [6, 7, 8, 2]])})
    >>> m(b).shape, m.user_state(b).shape, m.item_vectors().shape
    (torch.Size([2, 1]), torch.Size([2, 8]), torch.Size([9, 8]))
    """

    task = "next_item"

    class Config(ModelConfig):
        name: Literal["sasrec"] = Field("sasrec", description="the model's registered name")
        target: str | None = Field(None, description="the item feature (the next item of each "
                                   "row); None: the feature whose ids the history holds")
        history: str | None = Field(None, description="the item history (a `kind: sequence` "
                                    "list sharing the item's vocabulary); None: the data's "
                                    "only one")
        blocks: int = Field(2, ge=1, description="self-attention blocks")
        heads: int = Field(1, ge=1, description="attention heads (embedding_dim must divide "
                           "by it)")
        ffn_mult: int = Field(1, ge=1, description="the feed-forward layer's width, in "
                              "multiples of embedding_dim (1 in the paper)")
        dropout: float = Field(0.2, ge=0.0, lt=1.0, description="dropout on the embeddings, "
                               "attention weights and feed-forward outputs")
        loss: Literal["auto", "full", "sampled", "bce"] = Field(
            "auto", description="full: softmax over the whole catalogue; sampled: softmax "
            "over the next item and `negatives` items drawn uniformly; bce: the paper's "
            "binary loss against one drawn item; auto: full up to 100,000 items, else sampled")
        negatives: int = Field(256, ge=1, description="sampled: items drawn per batch")
        k: int = Field(10, ge=1, description="the cut-off of HitRate@K and NDCG@K (early "
                       "stopping follows NDCG@K)")
        exclude_history: bool = Field(False, description="evaluation: the items of the row's "
                                      "history cannot be recommended (the next item itself "
                                      "stays rankable)")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.history, self.target_column = schema.history_and_target("sasrec", cfg.history,
                                                                      cfg.target)
        if cfg.embedding_dim % cfg.heads:
            from sampan.errors import ConfigError

            raise ConfigError(f"sasrec: embedding_dim {cfg.embedding_dim} must be a multiple "
                              f"of heads {cfg.heads}")
        spec = next(s for s in schema.sequences if s.name == self.history)
        self.max_len = spec.max_len
        self.item_cardinality = schema.sparse[self.target_column].cardinality
        self.k, self.exclude_history = cfg.k, cfg.exclude_history
        self.loss_kind = cfg.loss if cfg.loss != "auto" else \
            ("full" if self.item_cardinality <= 100_000 else "sampled")
        self.negatives = cfg.negatives
        d = cfg.embedding_dim
        self.dim = d
        # only the item table: SASRec reads nothing but the item ids
        self.embedding = EmbeddingCollection(
            [t for t in schema.tables(d) if schema.sparse[self.target_column].name
             in t.features], cfg.embedding_init_std)
        self.position = nn.Embedding(self.max_len, d)
        nn.init.normal_(self.position.weight, 0.0, cfg.embedding_init_std)
        self.drop = nn.Dropout(cfg.dropout)
        layer = nn.TransformerEncoderLayer(d, cfg.heads, d * cfg.ffn_mult, cfg.dropout,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.heads = cfg.heads
        self.register_buffer("causal", torch.triu(torch.ones(self.max_len, self.max_len,
                                                             dtype=torch.bool), 1),
                             persistent=False)
        self.register_buffer("eye", torch.eye(self.max_len, dtype=torch.bool),
                             persistent=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Item vectors of ``ids [..]`` (through the history's table)."""
        empty = torch.zeros(0, len(self.embedding.offsets), dtype=torch.long,
                            device=ids.device)
        flat = ids.reshape(1, -1)
        return self.embedding.lookup(empty, {self.history: flat})[1][self.history] \
            .reshape(*ids.shape, self.dim)

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        """``seq [B, L]`` (left-padded item ids, most recent last) -> the state after each
        position ``[B, L, D]`` (each attends to itself and earlier positions)."""
        length = seq.shape[1]
        x = self._lookup(seq) * math.sqrt(self.dim)
        x = x + self.position.weight[-length:]
        pad = seq == 0
        x = self.drop(x) * (~pad).unsqueeze(-1)
        # no later position and no padding, but always itself: a padding position (and a
        # row with no history at all) attends to itself rather than to nothing, which would
        # be NaN and reach real positions through the next layer's weights
        mask = (self.causal[:length, :length].unsqueeze(0) | pad.unsqueeze(1)) & \
            ~self.eye[:length, :length]
        h = self.encoder(x, mask=mask.repeat_interleave(self.heads, dim=0))
        return self.norm(h)

    def user_state(self, batch: Batch) -> torch.Tensor:
        """The state after the last item of the history ``[B, D]``: what ranks the next.

        Leading padding changes nothing (it is masked and holds no position a real item
        reads), so rows are encoded in blocks of similar length, each cut to its longest
        history: most histories are far shorter than ``max_len``."""
        seq = batch.sequences[self.history]
        lengths = (seq != 0).sum(dim=1)
        if len(seq) <= self.BLOCK or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            return self.encode(seq)[:, -1]
        out = seq.new_empty((len(seq), self.dim), dtype=self.position.weight.dtype)
        order = torch.argsort(lengths)
        for lo in range(0, len(seq), self.BLOCK):
            rows = order[lo:lo + self.BLOCK]
            keep = max(1, int(lengths[rows].max()))
            out[rows] = self.encode(seq[rows, -keep:])[:, -1].to(out.dtype)
        return out

    BLOCK = 512  # rows encoded together when a batch is cut by history length

    def item_vectors(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Vectors of item ids ``ids`` (default: every id of the table, ``[N, D]``)."""
        if ids is None:
            ids = torch.arange(self.item_cardinality, device=self.position.weight.device)
        return self._lookup(ids)

    def forward(self, batch: Batch) -> torch.Tensor:
        state = self.user_state(batch)
        item = self._lookup(batch.sparse[:, self.target_column])
        return (state * item).sum(-1, keepdim=True)
