"""Blocks shared by several models."""

from sampan.layers.attention import TargetAttention
from sampan.layers.embed import FeatureEmbedding, FieldInput, embed_fields, pool
from sampan.layers.fm import FieldWeightedFM, fm_interaction, pair_interaction
from sampan.layers.linear import Linear
from sampan.layers.mlp import MLP, Dice, bias_terms

__all__ = ["Dice", "FeatureEmbedding", "FieldInput", "FieldWeightedFM", "Linear", "MLP",
           "TargetAttention", "bias_terms", "embed_fields", "fm_interaction",
           "pair_interaction", "pool"]
