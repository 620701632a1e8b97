"""Rewrite a generated block of the README between ``<!-- perf:KEY -->`` markers."""

from __future__ import annotations

from pathlib import Path


def update_block(path: Path, key: str, text: str, after: str | None = None) -> None:
    """Replace the block between this key's markers in ``path``. When it is absent, put it
    after the line of the last marker starting with ``after`` (the end of the file when
    there is none; a file that does not exist yet is made)."""
    begin, end = f"<!-- perf:{key} -->", f"<!-- /perf:{key} -->"
    doc = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    elif after and after in doc:
        cut = doc.index("\n", doc.rindex(after)) + 1
        doc = doc[:cut] + f"\n{block}\n" + doc[cut:]
    else:
        doc += f"\n{block}\n"
    path.write_text(doc)
    print(f"updated {path} ({key})")


def shown_command(args: str) -> str:
    """A benchmark's arguments as a reader reruns them: without ``--readme PATH`` (where the
    figures were written, not how they were measured)."""
    words = args.split()
    out = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == "--readme":
            skip = True
        elif not w.startswith("--readme="):
            out.append(w)
    return " ".join(out)
