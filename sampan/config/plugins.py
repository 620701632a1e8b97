"""User models from the user's own code: the config's ``plugins:`` list.

Each entry is a Python file (``my_models.py``; a relative path is taken from the config
file's folder, or the working directory for a config built in Python) or an importable
module (``my_pkg.rankers``). Sampan imports each one before it validates the ``model:``
section, so the ``@register_model("my_ranker")`` classes inside are known by name::

    plugins: [my_models.py]
    model: {name: my_ranker, hidden: 64}

A run saves the absolute paths in its ``config.yaml``, so ``sampan eval``, ``export``,
``--resume`` and ``compare`` load the same code. Check a model against the contract every
built-in model meets with :func:`sampan.testing.check_model`.

Importing a plugin runs its code, as ``import`` does: name only files you trust.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from sampan.errors import ConfigError

_LOADED: dict[str, object] = {}  # resolved entry -> module: each file runs once per process


def resolve(entry: str, base: Path | None = None) -> str:
    """``entry`` as it is saved: a ``.py`` file as an absolute path (relative to ``base``,
    else the working directory), a module name unchanged."""
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(f"plugins: expected a .py file or a module name, got {entry!r}")
    if entry.endswith(".py") or "/" in entry or "\\" in entry:
        path = Path(entry).expanduser()
        if not path.is_absolute():
            path = (base or Path.cwd()) / path
        return str(path.resolve())
    return entry


def load(entry: str, base: Path | None = None) -> str:
    """Import one plugin (once per process) and return its resolved entry."""
    key = resolve(entry, base)
    if key in _LOADED:
        return key
    if key.endswith(".py") or Path(key).is_absolute():
        path = Path(key)
        if not path.is_file():
            raise ConfigError(f"plugins: {entry!r} is not a file ({path} does not exist)")
        # a stable, unique module name per file: tracebacks and pickling name it
        name = f"sampan_plugin_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"plugins: cannot import {path} (not a Python file?)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except (KeyboardInterrupt, SystemExit):
            del sys.modules[name]
            raise
        except Exception as e:  # the user's file: say where, keep the cause chained
            del sys.modules[name]
            raise ConfigError(f"plugins: importing {path} failed: {_where(e, path)}; run "
                              f"`python {path}` to see the whole traceback") from e
    else:
        try:
            module = importlib.import_module(key)
        except ModuleNotFoundError as e:
            if e.name and key.startswith(e.name):
                raise ConfigError(f"plugins: no module named {key!r} (is it installed, or on "
                                  "PYTHONPATH?)") from None
            raise ConfigError(f"plugins: importing {key} failed: {_where(e, None)}") from e
        except Exception as e:
            raise ConfigError(f"plugins: importing {key} failed: {_where(e, None)}") from e
    _LOADED[key] = module
    return key


def _where(e: BaseException, path: Path | None) -> str:
    """``Kind: message (file:line)`` of an exception raised while importing a plugin."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}:{e.lineno})"
    tb = e.__traceback__
    line = None
    while tb is not None:  # the deepest frame inside the plugin's own file
        if path is None or Path(tb.tb_frame.f_code.co_filename) == path:
            line = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{type(e).__name__}: {e}" + (f" ({line})" if line else "")


def load_all(entries: list[str], base: Path | None = None) -> list[str]:
    """Import every plugin in order; returns the resolved entries (what a run saves)."""
    return [load(e, base) for e in entries]
