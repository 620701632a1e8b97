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
