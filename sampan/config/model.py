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


class MLPModelConfig(ModelConfig):
    """Options of models with an MLP over the fields."""

    mlp: list[PositiveInt] = Field(default_factory=lambda: [256, 128])
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    batch_norm: bool = False
