"""Registered models, one per file. ``build_model`` turns a config section into a module.

>>> from sampan.models import model_names
>>> len(model_names()), model_names()[:4]
(19, ['autoint', 'bst', 'dcn', 'dcn_v2'])
"""

from sampan.models import (  # noqa: F401  (importing registers the models)
    autoint,
    bst,
    dcn,
    dcn_v2,
    deepfm,
    dien,
    din,
    dnn,
    esmm,
    fibinet,
    fm,
    hstu,
    lr,
    mmoe,
    ple,
    sasrec,
    two_tower,
    wide_deep,
    xdeepfm,
)
from sampan.models.registry import build_model, get_model_class, model_names, register_model

__all__ = ["build_model", "get_model_class", "model_names", "register_model"]
