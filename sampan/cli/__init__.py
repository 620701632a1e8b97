"""The ``sampan`` command line: a thin layer over the library.

One module per command group (``train``, ``runs``: eval / compare / predict / export,
``serve``, ``data``, ``models``), all registered on the app of :mod:`~sampan.cli.base`, whose
one handler turns a :class:`~sampan.errors.SampanError` into ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import sys

# importing registers the commands, in the order --help lists them
from sampan.cli import train  # noqa: F401  # isort: skip
from sampan.cli import stream  # noqa: F401  # isort: skip
from sampan.cli import kafka  # noqa: F401  # isort: skip
from sampan.cli import tune  # noqa: F401  # isort: skip
from sampan.cli import experiment  # noqa: F401  # isort: skip
from sampan.cli import runs  # noqa: F401  # isort: skip
from sampan.cli import serve  # noqa: F401  # isort: skip
from sampan.cli import data  # noqa: F401  # isort: skip
from sampan.cli import convert  # noqa: F401  # isort: skip
from sampan.cli import models  # noqa: F401  # isort: skip
from sampan.cli.base import app, err  # isort: skip


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


__all__ = ["app", "main"]
