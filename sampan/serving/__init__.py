"""Serving: raw records -> the bundle's feature pipeline -> the exported graph -> scores."""

from sampan.serving.predictor import Predictor, RequestError

__all__ = ["Predictor", "RequestError"]
