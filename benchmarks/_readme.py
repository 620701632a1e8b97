"""Rewrite a generated block of the README between ``<!-- perf:KEY -->`` markers."""

from __future__ import annotations

from pathlib import Path


def update_block(path: Path, key: str, text: str) -> None:
    """Replace the block between this key's markers in ``path`` (append when absent)."""
    begin, end = f"<!-- perf:{key} -->", f"<!-- /perf:{key} -->"
    doc = path.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc += f"\n{block}\n"
    path.write_text(doc)
    print(f"updated {path} ({key})")
