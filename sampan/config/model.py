"""The ``model`` section's shared options; each model's nested ``Config`` adds its own."""

from __future__ import annotations

from pydantic import (
    Field,
    PositiveInt,
)

from sampan.config.base import _Strict


# ---------------------------------------------------------------------------------- model
class ModelConfig(_Strict):
    """Options shared by every model; each model's nested ``Config`` adds its own."""

    name: str = "deepfm"
    embedding_dim: int = Field(16, gt=0)
    embedding_init_std: float = Field(1e-2, gt=0)


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

    mlp: list[PositiveInt] = Field(default_factory=lambda: [256, 128])
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    batch_norm: bool = False
