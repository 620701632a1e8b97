"""Sampan's C kernels for the CPU, built on first use: one library from the ``.c`` files here.

* ``keymap.c``: a CPU :class:`~sampan.embedding.dynamic.KeyIndex` probes a batch of keys in
  one C pass over them (and stamps the rows it finds in the same pass), and inserts new
  keys the same way, instead of rounds of tensor operations and a sort of the whole batch:
  the sort is left to the keys that miss, a few percent of a training batch. The results
  are the same rows, stamps and evictions either way
  (``tests/unit/test_dynamic_index.py`` runs both).
* ``dense.c``: the backward of :class:`~sampan.layers.linear.Linear` on the CPU (fp32)
  makes the gradient at a layer's output ready for both GEMMs in one pass: the ReLU's
  backward, the bias's gradient, and the transposed copy that oneDNN's weight-gradient
  GEMM reads (``tests/unit/test_linear.py`` compares them with PyTorch's: the input and
  weight gradients to the bit, the bias's within fp32 rounding, as it is summed in another
  order).
* ``rows.c``: an embedding lookup's row ids deduplicated by one radix sort, and the
  gradients summed per distinct row (``tests/unit/test_embedding.py`` compares them with
  the tensor path).

The library is compiled the first time a process needs it, with the system C compiler
(``$CC``, else ``cc``; the one ``train.compile`` uses too), into
``$SAMPAN_CACHE_DIR/native`` (default ``~/.cache/sampan/native``; the temp directory when
that cannot be written) under a name made of the sources' hash, the compiler and its flags,
so a changed source is rebuilt and concurrent processes never load a half-written file.
``$CC`` may hold words of its own (``ccache gcc``). It is built with OpenMP where the
compiler has it (torch's own runtime serves it), else on one thread. Without a compiler,
or with ``SAMPAN_NATIVE=0``, the same work runs on tensor operations (as on a GPU), and
:func:`status` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why there is no library (None: not tried yet, or loaded)
_tried = False


def cache_root() -> Path:
    """``$SAMPAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/sampan`` or ``~/.cache/sampan``."""
    return Path(os.environ.get("SAMPAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sampan"))


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (set CC, or install gcc)")
    return shlex.split(cc)  # CC may carry words of its own ("ccache gcc")


def _cache_dirs() -> list[Path]:
    """Where a built library may go: the cache, else (not writable) the temp directory."""
    return [cache_root() / "native", Path(tempfile.gettempdir()) / "sampan-native"]


def _compile(cc: list[str], flags: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cc, "-O3", "-shared", "-fPIC", *flags, "-o", tmp,
                               *map(str, _SOURCES)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode:
            raise OSError(f"{' '.join(cc)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)  # atomic: another process sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> ctypes.CDLL:
    src = b"".join(p.name.encode() + p.read_bytes() for p in _SOURCES)
    cc = _compiler()
    error = "the C kernels could not be built"
    # with OpenMP first; without it (clang without libomp, at build or at load) one thread
    for flags in (["-fopenmp"], []):
        tag = hashlib.sha256(src + " ".join([*cc, *flags, platform.machine()]).encode()
                             ).hexdigest()[:16]
        for where in _cache_dirs():
            out = where / f"sampan-{tag}.so"
            try:
                if not out.exists():
                    _compile(cc, flags, out)
            except PermissionError as e:  # a directory we may not write: the next one
                error = str(e)
                continue
            except OSError as e:  # the compiler failed with these flags: the next flags
                error = str(e)
                break
            try:
                return _bind(ctypes.CDLL(str(out)))
            except OSError as e:  # built, but it does not load (a missing runtime)
                error = str(e)
                break
    raise OSError(error)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.keymap_probe.argtypes = [p, i64, p, p, p, p, i64, p, p, p, ctypes.c_int, i64,
                                 ctypes.c_int]
    lib.keymap_probe.restype = i64
    lib.keymap_insert.argtypes = [p, i64, p, p, i64, p]
    lib.keymap_insert.restype = i64
    lib.dense_grad.argtypes = [p, p, i64, i64, p, p, p, ctypes.c_int]
    lib.dense_grad.restype = ctypes.c_int
    lib.sort_dedup.argtypes = [p, i64, i64, p, p, p, p]
    lib.sort_dedup.restype = i64
    lib.segment_sum.argtypes = [p, i64, p, p, i64, p, ctypes.c_int]
    lib.segment_sum.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built if needed; None where they cannot be (see :func:`status`)."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("SAMPAN_NATIVE", "1").strip().lower() in ("0", "false", "off"):
                _why = "off: SAMPAN_NATIVE=0"
            else:
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError) as e:
                    _why = f"off: {e}"
            _tried = True
    return _lib


def status() -> str:
    """One line: whether the C kernels are in use, and why not."""
    return "on" if library() is not None else str(_why)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def probe(slots: torch.Tensor, mask: int, keys: torch.Tensor, tables: torch.Tensor | None,
          salts: torch.Tensor, starts: torch.Tensor, stamps: torch.Tensor | None,
          mode: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key's row in its table (0: none) and the positions of the keys that have none;
    ``mode`` 1 or 2 stamps the rows found (lru / lfu; ``stamps`` the map's row stamps), 0
    reads only. Every tensor contiguous int64 on the CPU."""
    lib = library()
    assert lib is not None
    out, miss = torch.empty_like(keys), torch.empty_like(keys)
    m = lib.keymap_probe(_ptr(slots), mask, _ptr(keys), _ptr(tables), _ptr(salts),
                         _ptr(starts), len(keys), _ptr(out), _ptr(miss), _ptr(stamps), mode,
                         step, torch.get_num_threads())
    return out, miss[:m]


def insert(slots: torch.Tensor, mask: int, keys: torch.Tensor, rows: torch.Tensor,
           row_slot: torch.Tensor) -> int:
    """Put absent, distinct salted ``keys`` with their index ``rows`` in the map; returns
    the empty slots used."""
    lib = library()
    assert lib is not None
    return int(lib.keymap_insert(_ptr(slots), mask, _ptr(keys), _ptr(rows), len(keys),
                                 _ptr(row_slot)))


def dense_grad(g: torch.Tensor, y: torch.Tensor | None, relu_out: torch.Tensor | None,
               transposed: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """In one pass over ``g [n, o]`` (contiguous fp32 on the CPU): ``relu_out`` = ``g``
    where ``y > 0`` else 0 (``y`` the layer's output, given with ``relu_out``; both None: no
    ReLU), ``transposed [o, n]`` = that gradient transposed, ``bias [o]`` = its column
    sums; each None is not written."""
    if (y is None) != (relu_out is None):
        raise ValueError("dense_grad: y and relu_out go together")
    lib = library()
    assert lib is not None
    n, o = g.shape
    if lib.dense_grad(_ptr(g), _ptr(y), n, o, _ptr(relu_out), _ptr(transposed), _ptr(bias),
                      torch.get_num_threads()):
        raise MemoryError(f"dense_grad: no memory for the bias sums of a [{n}, {o}] gradient")


def sort_dedup(keys: torch.Tensor, bound: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(uniq, inverse, order, counts)`` of the int64 ``keys`` (contiguous, on the CPU, in
    ``[0, bound)``, ``bound`` at most 2**32) by one stable radix sort; None when a key is
    out of that range (the caller's general path then says what is wrong)."""
    lib = library()
    assert lib is not None
    n = len(keys)
    order, uniq, counts, inverse = (torch.empty_like(keys) for _ in range(4))
    u = lib.sort_dedup(_ptr(keys), n, bound, _ptr(order), _ptr(uniq), _ptr(counts),
                       _ptr(inverse))
    if u == -1:
        raise MemoryError(f"sort_dedup: no memory to sort {n:,} keys")
    if u < 0:
        return None
    return uniq[:u], inverse, order, counts[:u]


def segment_sum(grads: torch.Tensor, order: torch.Tensor, counts: torch.Tensor
                ) -> torch.Tensor:
    """``[U, D]``: the rows of ``grads [N, D]`` (contiguous fp32 on the CPU) summed per
    group of ``order`` (``counts`` positions each), in position order."""
    lib = library()
    assert lib is not None
    out = grads.new_empty(len(counts), grads.shape[1])
    if lib.segment_sum(_ptr(grads), grads.shape[1], _ptr(order), _ptr(counts), len(counts),
                       _ptr(out), torch.get_num_threads()):
        raise MemoryError(f"segment_sum: no memory for {len(counts):,} rows")
    return out
