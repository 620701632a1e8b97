"""Pydantic's errors as one line per problem, with the nearest valid key."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any, Union

from pydantic import (
    BaseModel,
    ValidationError,
)


# --------------------------------------------------------------------- error messages
def format_validation_error(
    err: ValidationError, root: type[BaseModel], prefix: tuple[Any, ...] = ()
) -> str:
    """Turn pydantic's errors into one line per problem, with the nearest valid key."""
    lines: list[str] = []
    # A value that fits no member of a union gets one error per member: one line for all.
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in err.errors():
        # union members appear in the location as tags ("literal['auto']", "constrained-int")
        raw_loc = tuple(e["loc"])
        keep_last = e["type"] == "extra_forbidden"  # the last part is the user's own key
        loc = tuple(x for i, x in enumerate(raw_loc) if not (
            isinstance(x, str) and ("[" in x or x.startswith("constrained-"))
            and not (keep_last and i == len(raw_loc) - 1)))
        if loc in merged and e["type"] not in ("extra_forbidden", "missing"):
            merged[loc]["msg"] += f", or {e['msg'][0].lower()}{e['msg'][1:]}"
            continue
        merged[loc] = {**e, "loc": loc}
    for e in merged.values():
        loc = e["loc"]
        where = _loc_str(prefix + loc)
        if e["type"] == "extra_forbidden":
            valid = _keys_at(root, loc[:-1])
            near = nearest_key(str(loc[-1]), valid)
            hint = f"did you mean {near[0]!r}? " if near else ""
            parent = _loc_str(prefix + loc[:-1]) or "top level"
            lines.append(f"unknown key {loc[-1]!r} in {parent}: {hint}"
                         f"valid keys are: {', '.join(valid)}")
        elif e["type"] == "missing":
            lines.append(f"{where}: required key is missing")
        elif e["type"] == "invalid_key" and isinstance(e.get("input"), bool):
            # YAML 1.1 reads an unquoted on / off / yes / no as true / false
            valid = _keys_at(root, loc[:-1])
            parent = _loc_str(prefix + loc[:-1]) or "top level"
            lines.append(f"a key in {parent} was read as {e['input']!r}: YAML reads an "
                         "unquoted on, off, yes or no as a boolean (quote it if you meant "
                         f"the word); valid keys are: {', '.join(valid)}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{where or 'config'}: {e['msg']}{shown}")
    return "invalid config:\n  - " + "\n  - ".join(lines)


# Names other frameworks (DeepCTR, FuxiCTR, TorchRec, Keras) give to Sampan's keys: no
# spelling distance finds ``lr`` from ``learning_rate``.
SYNONYMS = {
    "learning_rate": "lr", "num_epochs": "epochs", "n_epochs": "epochs", "epoch": "epochs",
    "batch": "batch_size", "bs": "batch_size", "embedding_size": "embedding_dim",
    "embed_dim": "embedding_dim", "emb_dim": "embedding_dim",
    "dnn_hidden_units": "mlp", "hidden_units": "mlp", "dnn": "mlp",
    "dropout_rate": "dropout", "dnn_dropout": "dropout", "net_dropout": "dropout",
    "l2_reg_embedding": "embedding_l2", "embedding_regularizer": "embedding_l2",
    "optim": "optimizer", "model_name": "name",
}


def nearest_key(key: str, valid: list[str]) -> list[str]:
    """The valid key the user most likely meant: a known synonym, else the closest
    spelling."""
    if SYNONYMS.get(key.lower()) in valid:
        return [SYNONYMS[key.lower()]]
    return difflib.get_close_matches(key, valid, n=1, cutoff=0.5)


def _loc_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _keys_at(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the pydantic model reached by following ``loc`` from ``root``."""
    tp: Any = root
    for part in loc:
        tp = _unwrap(tp, want_item=isinstance(part, int))
        if isinstance(part, str) and isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(part)
            if field is None:
                return []
            tp = field.annotation
    tp = _unwrap(tp, want_item=False)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _unwrap(tp: Any, want_item: bool) -> Any:
    """Strip Optional / Annotated / list[...] down to the model class inside."""
    for _ in range(6):
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            lists = [a for a in args if typing.get_origin(a) is list]
            tp = models[0] if models and not want_item else (lists[0] if lists else args[0])
        elif origin is list and want_item:
            tp = typing.get_args(tp)[0]
            want_item = False
        else:
            break
    return tp
