"""Two-tower retrieval (Yi et al., 2019; Covington et al., 2016): a user tower and an item
tower map their own features to unit vectors whose dot product scores the pair. Trained with
in-batch sampled softmax and logQ correction (see :mod:`sampan.tasks.retrieval`)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.embedding import EmbeddingCollection
from sampan.errors import ConfigError
from sampan.layers import MLP, embed_fields
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("two_tower")
class TwoTower(nn.Module):
    """``Batch -> [B, 1]`` logits ``<u, v> / temperature`` of each row's (user, item) pair;
    ``user_vectors`` / ``item_vectors`` give the towers' unit vectors ``[B, out_dim]``.

    ``item_features`` names the item tower's features (sparse columns, bags, sequences or
    numeric, whose ``<name>_bucket`` twin comes along); every other feature goes to the user
    tower. ``item_id`` / ``user_id`` name the
    id columns used for the corpus, logQ and evaluation (default: the first sparse feature
    of each tower).
    """

    task = "retrieval"
    # cosine scores over a temperature of 0.05: bf16's 8-bit mantissa moves a logit by up to
    # ~0.08, which the sampled softmax over the batch's items feels (benchmarks/amp.py)
    amp_auto = "none"
    amp_why = ("the two-tower model's softmax over cosine scores / temperature feels bf16's "
               "rounding: its recall is lower after a short training, level at best once "
               "converged")

    class Config(ModelConfig):
        name: Literal["two_tower"] = Field("two_tower", description="the model's registered "
                                           "name")
        item_features: list[str] = Field(default_factory=lambda: ["item_id"],
                                         description="features of the item tower (a numeric "
                                         "one brings its `<name>_bucket` twin); every other "
                                         "feature goes to the user tower")
        item_id: str | None = Field(None, description="the item tower's sparse feature that "
                                    "identifies the item (corpus, logQ, evaluation); None: "
                                    "its first sparse feature")
        user_id: str | None = Field(None, description="the user tower's sparse feature that "
                                    "identifies the user in evaluation; None: its first "
                                    "sparse feature")
        tower_mlp: list[int] = Field(default_factory=lambda: [128, 64],
                                     description="hidden layer sizes of each tower, first to "
                                     "last; the last is the length of the user and item vectors")
        temperature: float = Field(0.05, gt=0, description="softmax temperature of the "
                                   "cosine scores")
        logq_correction: bool = Field(True, description="subtract log q(item), the item's "
                                      "share of the training positives, from each in-batch "
                                      "logit")
        k: int = Field(50, ge=1, description="cut-off of Recall@K / NDCG@K in evaluation")
        exclude_seen: bool = Field(True, description="evaluation skips items the user had "
                                   "in the train split")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.schema = schema
        fields = [f.name for f in schema.sparse] + [s.name for s in schema.sequences]
        known = fields + list(schema.dense)
        unknown = [n for n in cfg.item_features if n not in known]
        if unknown:
            raise ConfigError(f"two_tower: model.item_features {unknown} are not features of "
                             f"the data; known: {known}")
        # a numeric item feature's bucket twin (see NumericFeature.buckets) goes with it
        item = set(cfg.item_features) | {f"{n}_bucket" for n in cfg.item_features
                                          if f"{n}_bucket" in fields}
        self.item_feature_names = [n for n in known if n in item]
        sparse = [f.name for f in schema.sparse]
        self.item_column = self._id_column("item_id", cfg.item_id,
                                           [n for n in sparse if n in item], sparse)
        self.user_column = self._id_column("user_id", cfg.user_id,
                                           [n for n in sparse if n not in item], sparse)
        if schema.sparse[self.item_column].dynamic is not None:
            raise ConfigError(f"two_tower: the item feature {sparse[self.item_column]!r} is a "
                              "dynamic table, which retrieval does not support yet (its "
                              "corpus and log-Q correction index items by id); fit it a "
                              "vocabulary")
        self.item_cardinality = schema.sparse[self.item_column].cardinality
        self.user_cardinality = schema.sparse[self.user_column].cardinality
        self.temperature, self.logq_correction = cfg.temperature, cfg.logq_correction
        self.k, self.exclude_seen = cfg.k, cfg.exclude_seen
        d = cfg.embedding_dim
        self.embedding = EmbeddingCollection(schema.tables(d), cfg.embedding_init_std)
        self.register_buffer("item_fields", torch.tensor(
            [i for i, n in enumerate(fields) if n in item], dtype=torch.long), persistent=False)
        self.register_buffer("user_fields", torch.tensor(
            [i for i, n in enumerate(fields) if n not in item], dtype=torch.long),
            persistent=False)
        self.register_buffer("item_dense", torch.tensor(
            [i for i, n in enumerate(schema.dense) if n in item], dtype=torch.long),
            persistent=False)
        self.register_buffer("user_dense", torch.tensor(
            [i for i, n in enumerate(schema.dense) if n not in item], dtype=torch.long),
            persistent=False)
        if not len(self.user_fields):
            raise ConfigError("two_tower: every sparse feature is in model.item_features; the "
                             "user tower needs at least one (e.g. user_id)")
        self.user_tower = MLP(len(self.user_fields) * d + len(self.user_dense), cfg.tower_mlp)
        self.item_tower = MLP(len(self.item_fields) * d + len(self.item_dense), cfg.tower_mlp)

    @staticmethod
    def _id_column(what: str, name: str | None, side: list[str], sparse: list[str]) -> int:
        if name is None:
            if not side:
                raise ConfigError(f"two_tower: no sparse feature for model.{what} on that "
                                 "side; check model.item_features")
            name = side[0]
        if name not in side:
            raise ConfigError(f"two_tower: model.{what} {name!r} must be a sparse feature of "
                             f"its tower: {side}")
        return sparse.index(name)

    def _tower(self, batch: Batch, e: torch.Tensor, fields: torch.Tensor,
               dense: torch.Tensor, tower: nn.Module) -> torch.Tensor:
        x = torch.cat([e.index_select(1, fields).flatten(1),
                       batch.dense.index_select(1, dense)], dim=1)
        return F.normalize(tower(x), dim=-1)

    def user_vectors(self, batch: Batch) -> torch.Tensor:
        e, _ = embed_fields(self.embedding, batch, self.schema)
        return self._tower(batch, e, self.user_fields, self.user_dense, self.user_tower)

    def item_vectors(self, batch: Batch) -> torch.Tensor:
        e, _ = embed_fields(self.embedding, batch, self.schema)
        return self._tower(batch, e, self.item_fields, self.item_dense, self.item_tower)

    def vectors(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Both towers from one embedding lookup: ``(u [B, d], v [B, d])``."""
        e, _ = embed_fields(self.embedding, batch, self.schema)
        return (self._tower(batch, e, self.user_fields, self.user_dense, self.user_tower),
                self._tower(batch, e, self.item_fields, self.item_dense, self.item_tower))

    def forward(self, batch: Batch) -> torch.Tensor:
        u, v = self.vectors(batch)
        return (u * v).sum(dim=1, keepdim=True) / self.temperature
