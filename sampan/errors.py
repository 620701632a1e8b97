"""The base of every error a user should see as a one-line message.

The command line turns a :class:`SampanError` into ``error: <message>`` and a non-zero exit;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class SampanError(Exception):
    """A problem with the user's config, data or run, explained in the message."""


class DivergenceError(SampanError):
    """Training diverged (non-finite or exploding loss, or a validation LogLoss far above
    the base rate's) and could not be recovered; the last good checkpoint is kept."""


class CheckpointError(SampanError):
    """A checkpoint that cannot be used: missing, truncated, corrupt (its checksum does not
    match), foreign, or not writable; the message names the file."""


class BundleError(SampanError, ValueError):
    """An exported bundle that cannot be opened: not a bundle, an unsupported format, or a
    file that is missing, changed since export, not listed, or outside the bundle."""
