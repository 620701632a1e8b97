"""Losses and heads, kept out of the models (which only return logits)."""

from sampan.tasks.binary import binary_loss

__all__ = ["binary_loss"]
