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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sampan.distributed import PART, placeholder, shard_bounds  # noqa: F401  (ckpt.placeholder)
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
# A distributed run with row-sharded tables writes each table's rows (and their optimizer
# state) where they live: process k of W writes ``<name>.<tag>.part<k>-of-<W>.pt`` holding
# ``{"rows": {key: its rows}}``, and rank 0 then writes ``<name>.pt`` with a placeholder
# ``{PART: key, "rows": total rows}`` in place of each such tensor and ``"parts"`` naming the
# files. The tag (step and a random id, the same on every rank) is new at every save, so a
# save never overwrites a part that an existing checkpoint names. No process ever holds a
# whole table; readers take the rows they need (memory-mapped, so a process reads only its
# rows) or assemble whole tensors. The placeholder and the row bounds are defined with the
# row sharding (:mod:`sampan.distributed`), which writes them.


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
