"""Data: sources -> FeaturePipeline -> processed store -> BatchLoader.

A file format of your own: :func:`register_reader` (see the "Your own data format"
guide)."""

from sampan.config.registry import register_reader

__all__ = ["register_reader"]
