"""Which raw columns a source reads, and as what type; the line-number column every kept
row carries."""

from __future__ import annotations

from dataclasses import dataclass, field

LINE_COLUMN = "_line"  # source line number of each kept row, carried next to the data
NUMBER_RE = r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$"


@dataclass
class ColumnRoles:
    """Which raw columns are read, and as what type."""

    numeric: list[str] = field(default_factory=list)  # labels and numeric features: float64
    categorical: list[str] = field(default_factory=list)  # string
    required: list[str] = field(default_factory=list)  # rows missing these are rejected
    labels: list[str] = field(default_factory=list)  # must lie in [0, 1]
    lists: list[str] = field(default_factory=list)  # delimited strings or list columns

    @property
    def all(self) -> list[str]:
        seen: dict[str, None] = {}
        for c in self.numeric + self.categorical + self.lists:
            seen.setdefault(c, None)
        return list(seen)
