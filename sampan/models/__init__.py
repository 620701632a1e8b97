"""Registered models, one per file. ``build_model`` turns a config section into a module.

>>> from sampan.models import model_names
>>> model_names()
['dcn_v2', 'deepfm', 'din', 'fm', 'lr']
"""

from sampan.models import dcn_v2, deepfm, din, fm, lr  # noqa: F401  (registers the models)
from sampan.models.registry import build_model, get_model_class, model_names, register_model

__all__ = ["build_model", "get_model_class", "model_names", "register_model"]
