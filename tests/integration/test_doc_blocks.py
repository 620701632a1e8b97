"""Every runnable code block of the README and the tutorials, run as a reader runs it: in
order, from a folder laid out like the repository (its configs, and the datasets at
``../shared/data``), each bash block in ``bash -euo pipefail`` and each Python block in a
fresh interpreter. A block that cannot run here says why in the comment above it:
``<!-- doc-test: skip REASON -->``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "tutorials").glob("*.md"))]
SKIP = re.compile(r"<!-- doc-test: skip (.+?) -->")
# a page too long for the default run says so, and why: it runs under `pytest -m heavy`
HEAVY = re.compile(r"<!-- doc-test: heavy (.+?) -->")


def page_param(page: Path):  # type: ignore[no-untyped-def]
    heavy = HEAVY.search(page.read_text())
    return pytest.param(page, id=page.name,
                        marks=[pytest.mark.heavy] if heavy else [])


def blocks(path: Path) -> list[tuple[str, str, str | None]]:
    """``(language, code, reason to skip)`` of each bash and python block of a page."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(bash|python)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        above = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        skip = SKIP.search(above)
        out.append((m.group(1), "\n".join(lines[i + 1:j]), skip.group(1) if skip else None))
        i = j + 1
    return out


def test_the_pages_have_blocks_and_say_why_one_cannot_run():
    found = {p.name: blocks(p) for p in PAGES}
    assert found["README.md"] and found["quickstart.md"]
    skipped = [(p, code) for p, bs in found.items() for _, code, why in bs if why is not None]
    # the README's install commands are what CI runs (.ci/run), not this test
    assert all("pip install" in code for _, code in skipped), skipped


@pytest.mark.realdata
@pytest.mark.parametrize("page", [page_param(p) for p in PAGES])
def test_the_blocks_of_a_page_run_as_written(page, shared_data, tmp_path):
    runnable = [(lang, code) for lang, code, why in blocks(page) if why is None]
    if not runnable:
        pytest.skip(f"{page.name} has no block to run")
    if any("curl " in code for _, code in runnable) and shutil.which("curl") is None:
        pytest.skip(f"{page.name} needs curl")
    work = tmp_path / "repo"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "shared").symlink_to(shared_data.parent)  # ../shared/data from the repo
    for n, (lang, code) in enumerate(runnable):
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else \
            [sys.executable, "-c", code]
        r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (f"{page.name}, block {n} ({lang}):\n{code}\n--- output\n"
                                   f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
