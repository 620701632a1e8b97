"""Export a finished run as a self-contained bundle: the model graph, the fitted feature
pipeline and a manifest (see :mod:`sampan.export.bundle`)."""

from sampan.export.bundle import Bundle, export_run

__all__ = ["Bundle", "export_run"]
