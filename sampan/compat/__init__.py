"""Other tools' configs as Sampan experiments (see :mod:`sampan.compat.paddlerec`)."""
