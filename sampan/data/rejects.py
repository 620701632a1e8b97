"""Rejected rows: counted by reason and written to the rejects file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import IO, Any

from sampan.errors import DataError


class RejectLog:
    """Counts rows read / kept / rejected by reason and writes rejected rows as JSON lines."""

    def __init__(self, path: Path | None):
        self.path = path
        self.read = 0
        self.kept = 0
        self.blank = 0  # blank lines: no record, not counted in read
        self.reasons: Counter[str] = Counter()
        self.examples: list[dict[str, Any]] = []  # the first few rejects, also without a file
        # check_early may stop the run (a log that starts after other inputs' rows, whose
        # counts it does not hold, leaves that to the log of the first input)
        self.early = True
        self._fh: IO[str] | None = None
        # (file, line) of rows an earlier process of the same run already rejected and wrote
        # (a resumed stream reads some of its rows again): not counted or written again
        self.known: set[tuple[str, int]] = set()

    def load_known(self) -> None:
        """Take the rows the rejects file already holds as known (see ``known``)."""
        if self.path is None or not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    self.known.add((rec["file"], rec["line"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a kill: its row is rejected again

    @property
    def rejected(self) -> int:
        return sum(self.reasons.values())

    def reject(self, file: str, line: int | None, reason: str, column: str | None,
               text: str, value: Any = None) -> None:
        """Count and keep one rejected row: ``text`` is the row (its columns joined by the
        delimiter), ``value`` the bad cell's text where one cell was bad."""
        if (file, line) in self.known:  # read again after a resume: said before
            self.read -= 1
            return
        self.reasons[reason] += 1
        rec = {"file": file, "line": line, "reason": reason, "column": column, "text": text}
        if value is not None:
            rec["value"] = value
        if len(self.examples) < 10:
            self.examples.append(rec)
        if self.path is None:
            return
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def merge(self, other: RejectLog, file: str | None = None) -> None:
        """Add the counts of ``other`` (a closed log of other rows), and its rejected rows
        after this one's; ``file``: the name its rows' file goes by here (a worker may
        have read it under another)."""
        self.read += other.read
        self.kept += other.kept
        self.blank += other.blank
        self.reasons.update(other.reasons)
        named = [dict(e, file=file) if file else e for e in other.examples]
        self.examples += named[: max(0, 10 - len(self.examples))]
        if other.path is None or not other.path.exists() or self.path is None:
            return
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        with open(other.path, encoding="utf-8") as f:
            for line in f:
                if file:
                    rec = json.loads(line)
                    line = json.dumps({**rec, "file": file}, ensure_ascii=False) + "\n"
                self._fh.write(line)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def check(self, max_bad_fraction: float) -> None:
        """Fail when the share of rejected rows is above ``max_bad_fraction``."""
        if self.read and self.rejected / self.read > max_bad_fraction:
            where = f"; see {self.path}" if self.path else ""
            first = ""
            if self.examples:
                e = self.examples[0]
                col = f", column {e['column']!r}" if e["column"] else ""
                bad = f" {e['value']!r}" if "value" in e else ""
                first = (f". First: {e['file']} line {e['line']}{col}: "
                         f"{e['reason'].replace('_', ' ')}{bad} in {e['text'][:120]!r}")
            raise DataError(
                f"{self.rejected} of {self.read} rows ({self.rejected / self.read:.2%}) were "
                f"rejected, above data.max_bad_fraction={max_bad_fraction:g}. Reasons: "
                f"{dict(self.reasons)}{first}{where}"
            )

    def check_early(self) -> None:
        """Stop at once when the input is clearly misread (nothing kept of 1,000+ rows)
        instead of quarantining a whole file."""
        if self.early and self.read >= 1000 and self.kept == 0:
            raise DataError(
                f"the first {self.read:,} rows were all rejected {dict(self.reasons)}: check "
                f"data.format, data.delimiter, data.header and data.columns"
                + (f"; see {self.path}" if self.path else ""))

    def describe(self) -> str:
        """``read N rows, kept K, rejected R {reasons} -> rejects file[, B blank lines]``."""
        return (f"read {self.read:,} rows, kept {self.kept:,}, rejected {self.rejected:,}"
                + (f" {dict(self.reasons)} -> {self.path}" if self.rejected else "")
                + (f"; {self.blank:,} blank lines skipped" if self.blank else ""))

    def summary(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "rejected": self.rejected,
                "reasons": dict(self.reasons), "blank_lines": self.blank}
