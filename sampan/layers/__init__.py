"""Blocks shared by several models."""

from sampan.layers.embed import FeatureEmbedding
from sampan.layers.fm import fm_interaction
from sampan.layers.mlp import MLP, Dice

__all__ = ["Dice", "FeatureEmbedding", "MLP", "fm_interaction"]
