"""The ``model`` section's shared options; each model's nested ``Config`` adds its own."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    PositiveInt,
)

from sampan.config.base import _Strict


# ---------------------------------------------------------------------------------- model
class ModelConfig(_Strict):
    """Options shared by every model; each model's nested ``Config`` adds its own."""

    name: str = Field("deepfm", description="the model to train: a built-in one (sampan "
                      "models lists them) or one registered by plugins")
    embedding_dim: int = Field(16, gt=0, description="length of each embedding vector")
    embedding_init_std: float = Field(1e-2, gt=0, description="standard deviation of the "
                                      "normal distribution embedding rows start from")


class FieldWeightsConfig(_Strict):
    """Options of the models with a field-weighted FM term (``fm``, ``deepfm``)."""

    field_weights: bool = Field(
        True, description="a learned weight per pair of fields on the FM term (FwFM; "
        "starts at 1, the plain FM); false: Rendle's FM, every pair weighted 1")
    field_weights_l1: float = Field(
        0.1, ge=0.0, description="after each step every field-pair weight moves toward 0 by "
        "this fraction of its learning rate and stops there (an L1 proximal step): pairs "
        "whose gradient is noise end at 0; 0 turns it off")


class MLPModelConfig(ModelConfig):
    """Options of models with an MLP over the fields."""

    mlp: list[PositiveInt] = Field(default_factory=lambda: [256, 128],
                                   description="the MLP's hidden layer sizes, first to last")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability after each "
                           "hidden layer; 0: none")
    batch_norm: bool = Field(False, description="batch normalisation after each hidden "
                             "layer's linear map, before its activation")


class NextItemConfig(ModelConfig):
    """Options of the next-item models (``sasrec``, ``hstu``)."""

    target: str | None = Field(None, description="the item feature (the next item of each "
                               "row); None: the feature whose ids the history holds")
    history: str | None = Field(None, description="the item history (a `kind: sequence` list "
                                "sharing the item's vocabulary); None: the data's only one")
    blocks: int = Field(2, ge=1, description="attention blocks")
    heads: int = Field(1, ge=1, description="attention heads")
    dropout: float = Field(0.2, ge=0.0, lt=1.0, description="dropout on the embeddings, "
                           "attention and block outputs")
    similarity: Literal["dot", "cosine"] = Field(
        "dot", description="how a state scores an item: dot product, or cosine divided by "
        "temperature (both vectors L2-normalised, as HSTU's reference code does)")
    temperature: float = Field(0.05, gt=0.0, description="cosine: the softmax temperature")
    loss: Literal["auto", "full", "sampled", "bce"] = Field(
        "auto", description="full: softmax over the whole catalogue; sampled: softmax over "
        "the next item and `negatives` items drawn uniformly; bce: SASRec's binary loss "
        "against one drawn item; auto: full up to 100,000 items, else sampled")
    negatives: int = Field(256, ge=1, description="sampled: items drawn per batch")
    k: int = Field(10, ge=1, description="the cut-off of HitRate@K and NDCG@K (early "
                   "stopping follows NDCG@K)")
    exclude_history: bool = Field(False, description="evaluation: the items of the row's "
                                  "history cannot be recommended (the next item itself stays "
                                  "rankable)")
    item_features: list[str] = Field(default_factory=list, description="list features (bags) "
                                     "holding the attributes of the row's item, e.g. its "
                                     "categories and brand joined by item id: every item's "
                                     "vector, in the history and as the next item, adds the "
                                     "mean of its attributes' embeddings (each item's "
                                     "attributes are read from the training rows)")
