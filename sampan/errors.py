"""The base of every error a user should see as a one-line message.

The command line turns a :class:`SampanError` into ``error: <message>`` and exit code 2, in
one handler (``sampan.cli``); anything else is a bug and keeps its traceback. Each class also
derives from the builtin a caller would catch without knowing Sampan (``ValueError`` for a
bad value, ``FileNotFoundError`` for a missing path, ``KeyError`` for an unknown name).

Leaf module: imports nothing of Sampan, so every layer can raise these.
"""

from __future__ import annotations

from pathlib import Path


class SampanError(Exception):
    """A problem with the user's config, data or run, explained in the message."""


class ConfigError(SampanError, ValueError):
    """A config file or override is invalid. The message lists every problem found."""


class DataError(SampanError, ValueError):
    """The input data cannot be used as configured (missing file, column, too many bad rows)."""


class UnknownModelError(SampanError, KeyError):
    """A config names a model that is not registered; the message lists the known names."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class RunError(SampanError, ValueError):
    """A run directory that cannot be used for what was asked (a split it does not have, a
    label it does not predict, runs that did not score the same rows)."""


class MissingExtraError(SampanError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the
    extra that brings it."""


class MissingPathError(SampanError, FileNotFoundError):
    """A path the user named (a run directory, a checkpoint, a file) does not exist or is
    not what it should be."""


def not_a_run(path: Path) -> MissingPathError:
    """The error for a folder that is not a run, naming the runs under it (a config's
    ``output_dir/name`` holds one timestamped folder per run), newest first."""
    found = Path(path).glob("*/config.yaml") if Path(path).is_dir() else []
    runs = sorted((p.parent for p in found),
                  key=lambda p: (p / "config.yaml").stat().st_mtime, reverse=True)
    hint = (f"; the runs under it, newest first: {', '.join(str(r) for r in runs[:3])}"
            + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")) if runs else ""
    return MissingPathError(f"{path} is not a Sampan run directory (no config.yaml){hint}")


class ExistingPathError(SampanError, FileExistsError):
    """A path that must be new (a run directory, an export bundle) already exists."""


class ExportError(SampanError, RuntimeError):
    """An export that cannot be trusted: the exported graph disagrees with PyTorch on the
    run's own rows, so no bundle is written."""


class DivergenceError(SampanError):
    """Training diverged (non-finite or exploding loss, or a validation LogLoss far above
    the base rate's) and could not be recovered; the last good checkpoint is kept."""


class CheckpointError(SampanError):
    """A checkpoint that cannot be used: missing, truncated, corrupt (its checksum does not
    match), foreign, or not writable; the message names the file."""


class BundleError(SampanError, ValueError):
    """An exported bundle that cannot be opened: not a bundle, an unsupported format, or a
    file that is missing, changed since export, not listed, or outside the bundle."""


class RequestError(SampanError, ValueError):
    """A request the predictor cannot score; ``field`` names the offending input (HTTP 400,
    gRPC INVALID_ARGUMENT)."""

    def __init__(self, message: str, field: str | None = None, record: int | None = None):
        super().__init__(message)
        self.field, self.record = field, record

    def to_json(self) -> dict[str, object]:
        return {"error": str(self), "field": self.field, "record": self.record}


class ConflictError(RequestError):
    """A request this server's set-up cannot take (HTTP 409, gRPC FAILED_PRECONDITION): a
    route the served bundles do not support (ranking without an item feature, recommending
    without a retrieval model, events without live histories), or events for per-worker
    memory."""
