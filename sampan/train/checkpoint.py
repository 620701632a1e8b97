"""Checkpoints written atomically (temporary file + rename), checksummed, and loaded
without pickle code paths.

A checkpoint holds everything a resumed run needs to continue exactly: model, both
optimizers, the step / loader position, early-stopping state, every RNG state and the
resolved config. ``torch.load(weights_only=True)`` reads it, so loading never executes
arbitrary code.

Every file ends with a trailer holding the sha256 of the bytes before it
(``\\nsampan-sha256:<64 hex>\\n``; ``torch.load`` ignores bytes after the archive). Loading
checks it first, so a flipped bit, a truncated or empty file, or a file that is no Sampan
checkpoint is a :class:`~sampan.errors.CheckpointError` naming the file, never silently
different weights or a raw unpickling traceback.
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sampan.distributed.sharded_embedding import RowShardedCollection, shard_bounds
from sampan.errors import CheckpointError, MissingPathError

_MARK = b"\nsampan-sha256:"
_TRAILER = len(_MARK) + 64 + 1


def _digest(f: Any, size: int) -> str:
    """sha256 of the first ``size`` bytes of the open file ``f``."""
    h = hashlib.sha256()
    f.seek(0)
    left = size
    while left:
        block = f.read(min(left, 8 << 20))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def save_atomic(obj: dict[str, Any], path: str | Path) -> None:
    """Write ``obj`` with ``torch.save`` to ``path``, with its checksum trailer, so that
    readers never see a partial file. On failure (a full disk) the temporary file is
    removed and a :class:`CheckpointError` says where it could not be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w+b") as f:
            torch.save(obj, f)
            f.flush()
            size = f.tell()
            digest = _digest(f, size)
            f.seek(size)
            f.write(_MARK + digest.encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {e.strerror or e}"
                                  " (the previous checkpoint there is kept)") from e
        raise


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete the temporary files that processes killed mid-write left in ``folder``
    (``.NAME.tmp-PID`` of a PID no longer running); returns them."""
    gone = []
    for p in folder.glob(".*.tmp-*"):
        pid = p.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
            gone.append(p)
        except PermissionError:
            pass  # alive, another user's
    return gone


def verify(path: str | Path) -> None:
    """Check ``path`` against the sha256 in its trailer (:class:`CheckpointError` if not)."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _TRAILER:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is {'empty' if not size else f'{size} bytes'}: "
                "not a complete Sampan checkpoint (truncated, or written by something else)")
        f.seek(size - _TRAILER)
        trailer = f.read(_TRAILER)
        if not trailer.startswith(_MARK) or not trailer.endswith(b"\n"):
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no Sampan checksum at its end: it is "
                "truncated or was not written by Sampan; resume from another checkpoint "
                "or train again")
        if _digest(f, size - _TRAILER) != trailer[len(_MARK):-1].decode("ascii", "replace"):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is corrupt: its bytes no longer match the sha256 "
                "written with it (a disk error or an edit); it was not used")


def _torch_load(path: Path, device: Any, mmap: bool = False) -> Any:
    verify(path)
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - checksummed but unreadable: say which file
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e


# ----------------------------------------------------------------- row-sharded parts
# The one place that knows the part-file protocol. A distributed run with row-sharded
# tables writes each table's rows (and their optimizer state) where they live: process k of
# W writes ``<name>.<tag>.part<k>-of-<W>.pt`` holding ``{"rows": {key: its rows}}``, and
# rank 0 then writes ``<name>.pt`` with a placeholder ``{PART: key, "rows": total rows}`` in
# place of each such tensor and ``"parts"`` naming the files. The tag (step and a random id,
# the same on every rank) is new at every save, so a save never overwrites a part that an
# existing checkpoint names. No process ever holds a whole table; readers take the rows they
# need (memory-mapped, so a process reads only its rows) or assemble whole tensors. Part keys
# are ``model/<state-dict key>`` and ``sparse_opt/<param index>/<state name>``.
PART = "__rows_in_parts__"


def placeholder(key: str, rows: int) -> dict[str, Any]:
    return {PART: key, "rows": rows}


def _sharded(model: torch.nn.Module) -> list[tuple[str, RowShardedCollection]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RowShardedCollection)]


def _weight_key(name: str) -> str:
    """A table's state-dict key (its part key is ``model/`` + it)."""
    return f"{name}.weight" if name else "weight"


def _sharded_params(model: torch.nn.Module, opt: torch.optim.Optimizer | None
                    ) -> dict[int, RowShardedCollection]:
    """The sparse optimizer's parameter index -> the row-sharded table it is."""
    tables = {id(m.weight): m for _, m in _sharded(model)}
    params = [] if opt is None else [p for g in opt.param_groups for p in g["params"]]
    return {i: tables[id(p)] for i, p in enumerate(params) if id(p) in tables}


def split_sharded_state(model: torch.nn.Module, obj: dict,
                        opt: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """A checkpoint ``obj`` (``"model"`` and maybe ``"sparse_opt"``, the state dict of
    ``opt``, of this rank) with this rank's rows of every row-sharded table, and their
    per-row optimizer state, replaced by placeholders; and those rows by part key, for
    :func:`save_part`."""
    rows: dict[str, torch.Tensor] = {}
    sd = dict(obj["model"])
    for name, m in _sharded(model):
        w = _weight_key(name)
        rows[f"model/{w}"] = sd[w]
        sd[w] = placeholder(f"model/{w}", m.num_rows)
    out = {**obj, "model": sd}
    opt_sd = obj.get("sparse_opt")
    if opt_sd is not None:
        state = dict(opt_sd["state"])
        for i, m in _sharded_params(model, opt).items():
            if i not in state:
                continue
            entry = dict(state[i])
            for k, v in entry.items():
                if torch.is_tensor(v) and v.dim() and v.shape[0] == m.hi - m.lo:
                    rows[f"sparse_opt/{i}/{k}"] = v
                    entry[k] = placeholder(f"sparse_opt/{i}/{k}", m.num_rows)
            state[i] = entry
        out["sparse_opt"] = {**opt_sd, "state": state}
    return out, rows


def local_rows_of(model: torch.nn.Module,  # type: ignore[no-untyped-def]
                  opt: torch.optim.Optimizer | None = None):
    """For :func:`load`: this rank's ``(lo, hi)`` of each row-sharded table and of its
    optimizer state, so a process reads only its rows; ``None`` when nothing is sharded."""
    sharded = _sharded(model)
    if not sharded:
        return None
    want = {f"model/{_weight_key(name)}": (m.lo, m.hi, m.num_rows) for name, m in sharded}
    for i, m in _sharded_params(model, opt).items():
        want[f"sparse_opt/{i}"] = (m.lo, m.hi, m.num_rows)

    def rows_of(key: str, total: int) -> tuple[int, int] | None:
        got = want.get(key) or want.get(key.rsplit("/", 1)[0])
        return got[:2] if got is not None and got[2] == total else None

    return rows_of


def shard_optimizer_state_dict(sd: dict, opt: torch.optim.Optimizer,
                               model: torch.nn.Module) -> dict:
    """A whole-table optimizer state dict cut to this rank's rows (before loading it, so the
    whole state never reaches the device); unchanged when nothing is sharded."""
    state = dict(sd["state"])
    for i, m in _sharded_params(model, opt).items():
        if i in state:
            state[i] = {k: v[m.lo: m.hi].clone() if torch.is_tensor(v) and v.dim() and
                        v.shape[0] == m.num_rows else v for k, v in state[i].items()}
    return {**sd, "state": state}


def part_name(path: str | Path, tag: str, rank: int, world: int) -> str:
    return f"{Path(path).stem}.{tag}.part{rank}-of-{world}.pt"


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU with a storage of its own size (``torch.save`` writes a view's whole
    storage, e.g. the whole memory-mapped part a resumed row range was read from)."""
    t = t.detach().cpu()
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def save_part(rows: dict[str, torch.Tensor], path: str | Path, tag: str, rank: int,
              world: int) -> None:
    """This process's rows of every row-sharded tensor of the checkpoint ``path``. Written
    before ``path`` itself (see :func:`save_with_parts`), so ``path`` never names a part
    that is not complete."""
    save_atomic({"rows": {k: _compact(v) for k, v in rows.items()}},
                Path(path).with_name(part_name(path, tag, rank, world)))


def save_with_parts(obj: dict[str, Any], path: str | Path, tag: str, world: int) -> None:
    """Rank 0, after every process's :func:`save_part`: ``obj`` (placeholders in place of
    the sharded tensors) naming its parts; then the parts of earlier checkpoints at ``path``
    are removed."""
    path = Path(path)
    names = [part_name(path, tag, k, world) for k in range(world)]
    save_atomic({**obj, "parts": {"world": world, "files": names}}, path)
    remove_parts(path, keep=names)


def remove_parts(path: str | Path, keep: list[str] | tuple[str, ...] = ()) -> None:
    """Delete the part files of earlier checkpoints at ``path`` (all but ``keep``)."""
    path = Path(path)
    for old in path.parent.glob(f"{path.stem}.*.part*-of-*.pt"):
        if old.name not in keep:
            old.unlink(missing_ok=True)


def save_run_checkpoint(obj: dict[str, Any], path: str | Path, model: torch.nn.Module,
                        sparse_opt: torch.optim.Optimizer | None, strategy: Any,
                        tag: str) -> Path:
    """Write a training checkpoint (collective: every process calls it). Rank 0 writes
    ``path``; with row-sharded tables each process first writes its rows and their
    optimizer state to a part file of its own (``tag`` plus a random id names the parts),
    so no process ever holds a whole table."""
    path = Path(path)
    if _sharded(model):
        obj, rows = split_sharded_state(model, obj, sparse_opt)
        tag = str(strategy.broadcast(f"{tag}-{secrets.token_hex(4)}"))  # new at every save
        save_part(rows, path, tag, strategy.rank, strategy.world)
        strategy.barrier()
        if strategy.is_main:
            save_with_parts(obj, path, tag, strategy.world)
    elif strategy.is_main:
        save_atomic(obj, path)
        remove_parts(path)  # those of a row-sharded run this one resumed
    strategy.barrier()
    return path


def load(path: str | Path, device: str | torch.device = "cpu",
         rows_of: Any = None) -> dict[str, Any]:
    """A checkpoint, with the tensors of row-sharded parts put back: whole, or, where
    ``rows_of(key, total_rows)`` gives ``(lo, hi)``, only those rows (read from the parts
    that hold them, so the rest never reaches memory)."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"checkpoint {str(path)!r} does not exist")
    for attempt in (0, 1):
        obj = _torch_load(path, device)
        if not isinstance(obj, dict):
            raise CheckpointError(f"checkpoint {str(path)!r} holds a {type(obj).__name__}, "
                                  "not a Sampan checkpoint")
        parts = obj.pop("parts", None)
        if parts is None:
            return obj
        files = [path.with_name(f) for f in parts["files"]]
        try:  # opened (mapped) at once: a newer save may remove them from the directory
            opened = [_torch_load(f, device, mmap=True)["rows"] for f in files]
            break
        except FileNotFoundError:
            if attempt:  # not a save replacing them in between: they are gone
                missing = [str(f) for f in files if not f.exists()]
                raise MissingPathError(
                    f"checkpoint {str(path)!r} is missing its parts {missing}") from None
    def fill(x: Any) -> Any:
        if isinstance(x, dict) and PART in x:
            key, n = x[PART], x["rows"]
            want = rows_of(key, n) if rows_of is not None else None
            lo, hi = want if want is not None else (0, n)
            bounds = shard_bounds(n, parts["world"])
            pieces = [opened[k][key][max(lo, a) - a: min(hi, b) - a]
                      for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
                      if max(lo, a) < min(hi, b)]
            if len(pieces) == 1:  # memory-mapped (copy-on-write): copied where it is used
                return pieces[0]
            return torch.cat(pieces) if pieces else opened[0][key][:0].clone()
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        return x

    return fill(obj)


def rng_state() -> dict[str, Any]:
    """Every RNG a training step can touch, in a form ``weights_only`` loading accepts."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
