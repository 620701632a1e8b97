"""Data: sources -> FeaturePipeline -> processed store -> BatchLoader."""
