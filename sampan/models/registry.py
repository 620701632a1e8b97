"""Building a model from its config section. The registry itself (``register_model``,
``get_model_class``, ``model_names``) is :mod:`sampan.config.registry`, importable from
here as model files and users' plugins have always taken it."""

from __future__ import annotations

from sampan.config.registry import (  # noqa: F401  (the names model files import from here)
    UnknownModelError,
    check_embeds_something,
    get_model_class,
    model_names,
    register_model,
)


def build_model(model_cfg, schema):  # type: ignore[no-untyped-def]
    """Instantiate the model named by ``model_cfg.name`` for a :class:`DataSchema`."""
    cls = get_model_class(model_cfg.name)
    if not isinstance(model_cfg, cls.Config):
        model_cfg = cls.Config.model_validate(model_cfg.model_dump())
    check_embeds_something(model_cfg.name, bool(schema.sparse or schema.sequences))
    return cls(schema, model_cfg)
