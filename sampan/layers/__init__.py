"""Blocks shared by several models."""

from sampan.layers.embed import FeatureEmbedding
from sampan.layers.fm import fm_interaction
from sampan.layers.mlp import MLP

__all__ = ["FeatureEmbedding", "MLP", "fm_interaction"]
