"""The state of row-sharded tables in checkpoints: placeholders for the rows that live in
per-rank part files, and each rank's rows of a whole state (see sampan.train.checkpoint)."""

from __future__ import annotations

from typing import Any

import torch

from sampan.distributed.context import context

# A row-sharded tensor in a checkpoint: its rows are in part files (see
# sampan.train.checkpoint, which writes and reads them)
PART = "__rows_in_parts__"


def placeholder(key: str, rows: int) -> dict[str, Any]:
    return {PART: key, "rows": rows}


def _sharded(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from sampan.embedding import EmbeddingCollection

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, EmbeddingCollection) and m.sharded]


def any_sharded(model: torch.nn.Module) -> bool:
    return bool(_sharded(model))


def _weight(name: str) -> str:
    """A table's state-dict key (checkpoint part keys are ``model/`` + it)."""
    return f"{name}.weight" if name else "weight"


def split_sharded_state(model: torch.nn.Module, obj: dict,
                        opt: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """A checkpoint ``obj`` (``"model"`` and maybe ``"sparse_opt"``, the state dict of
    ``opt``, of this rank) with this rank's rows of every row-sharded table, and their
    per-row optimizer state, replaced by placeholders; and those rows by key, for
    :func:`checkpoint.save_part`."""
    rows: dict[str, torch.Tensor] = {}
    sd = dict(obj["model"])
    sharded = _sharded(model)
    for name, m in sharded:
        w = _weight(name)
        rows[f"model/{w}"] = sd[w]
        sd[w] = placeholder(f"model/{w}", m.num_rows)
    out = {**obj, "model": sd}
    opt_sd = obj.get("sparse_opt")
    if opt_sd is not None and opt is not None:
        tables = {id(m.weight): m for _, m in sharded}
        state = dict(opt_sd["state"])
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
            m = tables.get(id(p))
            if m is None or i not in state:
                continue
            entry = dict(state[i])
            for k, v in entry.items():
                if torch.is_tensor(v) and v.dim() and v.shape[0] == p.shape[0]:
                    rows[f"sparse_opt/{i}/{k}"] = v
                    entry[k] = placeholder(f"sparse_opt/{i}/{k}", m.num_rows)
            state[i] = entry
        out["sparse_opt"] = {**opt_sd, "state": state}
    return out, rows


def local_rows_of(model: torch.nn.Module,  # type: ignore[no-untyped-def]
                  opt: torch.optim.Optimizer | None = None):
    """For :func:`checkpoint.load`: this rank's ``(lo, hi)`` of each row-sharded table and of
    its optimizer state, so a process reads only its rows; ``None`` when nothing is sharded."""
    sharded = _sharded(model)
    if not sharded:
        return None
    r = context().rank
    want = {f"model/{_weight(name)}": (m.bounds[r], m.bounds[r + 1], m.num_rows)
            for name, m in sharded}
    tables = {id(m.weight): (m.bounds[r], m.bounds[r + 1], m.num_rows) for _, m in sharded}
    params = [] if opt is None else [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if id(p) in tables:
            want[f"sparse_opt/{i}"] = tables[id(p)]

    def rows_of(key: str, total: int) -> tuple[int, int] | None:
        got = want.get(key) or want.get(key.rsplit("/", 1)[0])
        return got[:2] if got is not None and got[2] == total else None

    return rows_of


def shard_optimizer_state_dict(sd: dict, opt: torch.optim.Optimizer,
                               model: torch.nn.Module) -> dict:
    """A whole-table optimizer state dict cut to this rank's rows (before loading it, so the
    whole state never reaches the device)."""
    shards = {id(m.weight): m for _, m in _sharded(model)}
    params = [p for g in opt.param_groups for p in g["params"]]
    state = dict(sd["state"])
    for i, p in enumerate(params):
        m = shards.get(id(p))
        if m is None or i not in state:
            continue
        lo, hi = m.bounds[context().rank], m.bounds[context().rank + 1]
        state[i] = {k: v[lo:hi].clone() if torch.is_tensor(v) and v.dim() and
                    v.shape[0] == m.num_rows else v for k, v in state[i].items()}
    return {**sd, "state": state}
