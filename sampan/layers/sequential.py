"""What the next-item models (SASRec, HSTU) share: the item table, the input embedding, the
blocked encoding of a batch by history length, and how a state scores an item.

A subclass builds its blocks and implements :meth:`NextItemEncoder.blocks_forward`; the
next-item task (:mod:`sampan.tasks.next_item`) reads :meth:`encode`, :meth:`user_state` and
:meth:`item_vectors`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sampan.batch import Batch
from sampan.config import NextItemConfig
from sampan.embedding import EmbeddingCollection
from sampan.errors import ConfigError
from sampan.schema import DataSchema


class NextItemEncoder(nn.Module):
    """``Batch -> [B, 1]``: the score of the row's item (``target``) as the next item after
    its history; :meth:`encode` gives the state after every position of a history.

    The item embeddings are the rows of the target's table, shared by the history (which
    must ``share`` the target's vocabulary); they are the output layer too. Histories are
    left-padded, most recent last, and position ``p`` of a history of ``max_len`` reads
    position embedding ``p``: a state depends only on the real items before it, so leading
    padding can be cut (:meth:`user_state` and the task encode blocks of rows of similar
    length, each cut to its longest history).
    """

    task = "next_item"
    BLOCK = 512  # rows encoded together when a batch is cut by history length

    def __init__(self, schema: DataSchema, cfg: NextItemConfig, model: str):
        super().__init__()
        self.history, self.target_column = schema.history_and_target(model, cfg.history,
                                                                      cfg.target)
        spec = next(s for s in schema.sequences if s.name == self.history)
        self.max_len = spec.max_len
        item = schema.sparse[self.target_column].name
        self.item_cardinality = schema.sparse[self.target_column].cardinality
        self.k, self.exclude_history = cfg.k, cfg.exclude_history
        self.loss_kind = cfg.loss if cfg.loss != "auto" else \
            ("full" if self.item_cardinality <= 100_000 else "sampled")
        self.negatives = cfg.negatives
        self.dim, self.heads = cfg.embedding_dim, cfg.heads
        self.cosine = cfg.similarity == "cosine"
        self.scale = 1.0 / math.sqrt(cfg.temperature)
        # each item's attribute ids per item feature (rows of the item table; filled from
        # the training rows by fit_data, saved with the weights)
        bags = {s.name: s for s in schema.sequences}
        for name in cfg.item_features:
            if name not in bags or name == self.history:
                raise ConfigError(f"{model}: model.item_features names {name!r}, which is not "
                                  "a list feature of the item; the data's lists: "
                                  f"{sorted(n for n in bags if n != self.history)}")
        self.item_features = list(cfg.item_features)
        for name in self.item_features:
            self.register_buffer(f"attributes_{name}", torch.zeros(
                self.item_cardinality, bags[name].max_len, dtype=torch.long))
        # the item table and the attributes' tables: nothing else is read
        wanted = {item, *(bags[n].table for n in self.item_features)}
        self.embedding = EmbeddingCollection(
            [t for t in schema.tables(cfg.embedding_dim) if wanted & set(t.features)],
            cfg.embedding_init_std)
        self.position = nn.Embedding(self.max_len, cfg.embedding_dim)
        nn.init.normal_(self.position.weight, 0.0, cfg.embedding_init_std)
        self.drop = nn.Dropout(cfg.dropout)

    @staticmethod
    def check_heads(model: str, dim: int, heads: int) -> None:
        if dim % heads:
            raise ConfigError(f"{model}: embedding_dim {dim} must be a multiple of heads "
                              f"{heads}")

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Item vectors of ``ids [...]`` (through the history's table), plus the mean of
        each item feature's attribute vectors."""
        empty = torch.zeros(0, len(self.embedding.offsets), dtype=torch.long,
                            device=ids.device)
        flat = ids.reshape(-1)
        attrs = {n: getattr(self, f"attributes_{n}")[flat] for n in self.item_features}
        looked = self.embedding.lookup(empty, {self.history: flat.unsqueeze(0)} | {
            n: a.reshape(1, -1) for n, a in attrs.items()})[1]
        v = looked[self.history].reshape(-1, self.dim)
        for n, a in attrs.items():
            real = (a != 0).unsqueeze(-1).to(v.dtype)
            vecs = looked[n].reshape(*a.shape, self.dim)
            v = v + (vecs * real).sum(1) / real.sum(1).clamp_min(1.0)
        return v.reshape(*ids.shape, self.dim)

    def fit_data(self, train: Any) -> str | None:
        """Read each item's attributes (``item_features``) from the training rows: the
        attributes of a row's next item. Returns what it found, for the run header."""
        if not self.item_features:
            return None
        rows = train.positive_rows()
        target = np.asarray(train.sparse[rows, self.target_column])
        found = []
        for n in self.item_features:
            table = getattr(self, f"attributes_{n}")
            values = torch.from_numpy(np.asarray(train.sequences[n])[rows]).to(table)
            table.zero_()
            table[torch.from_numpy(target).to(table.device)] = values
            table[:2] = 0  # padding and OOV have no attributes
            known = int((table != 0).any(dim=1).sum())
            found.append(f"{n} for {known:,} of {self.item_cardinality - 2:,} items")
        return "item attributes: " + "; ".join(found)

    def _out(self, v: torch.Tensor) -> torch.Tensor:
        """A state or an item vector as it enters the score (a dot product): with cosine
        similarity L2-normalised and scaled so that the dot product is cos / temperature."""
        return F.normalize(v, dim=-1) * self.scale if self.cosine else v

    def blocks_forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """``x [B, L, D]`` (padding positions zero), ``pad [B, L]`` -> ``[B, L, D]``, each
        position reading only itself and earlier real positions."""
        raise NotImplementedError

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        """``seq [B, L]`` (left-padded item ids, most recent last) -> the state after each
        position ``[B, L, D]``."""
        length = seq.shape[1]
        pad = seq == 0
        x = self._lookup(seq) * math.sqrt(self.dim) + self.position.weight[-length:]
        x = self.drop(x) * (~pad).unsqueeze(-1)
        return self._out(self.blocks_forward(x, pad))

    def user_state(self, batch: Batch) -> torch.Tensor:
        """The state after the last item of the history ``[B, D]``: what ranks the next.
        Rows go through in blocks of similar length, each cut to its longest history."""
        seq = batch.sequences[self.history]
        # an exported graph encodes the batch whole (a branch on its size would fix it)
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or len(seq) <= self.BLOCK:
            return self.encode(seq)[:, -1]
        lengths = (seq != 0).sum(dim=1)
        out = seq.new_empty((len(seq), self.dim), dtype=self.position.weight.dtype)
        order = torch.argsort(lengths)
        for lo in range(0, len(seq), self.BLOCK):
            rows = order[lo:lo + self.BLOCK]
            keep = max(1, int(lengths[rows].max()))
            out[rows] = self.encode(seq[rows, -keep:])[:, -1].to(out.dtype)
        return out

    def user_vectors(self, batch: Batch) -> torch.Tensor:
        """:meth:`user_state`, under the name an exported retrieval bundle's user tower
        reads (the state searches the item index by inner product)."""
        return self.user_state(batch)

    def item_vectors(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Vectors of item ids ``ids`` (default: every id of the table, ``[N, D]``), as
        they enter the score."""
        if ids is None:
            ids = torch.arange(self.item_cardinality, device=self.position.weight.device)
        return self._out(self._lookup(ids))

    def forward(self, batch: Batch) -> torch.Tensor:
        state = self.user_state(batch)
        item = self.item_vectors(batch.sparse[:, self.target_column])
        return (state * item).sum(-1, keepdim=True)
