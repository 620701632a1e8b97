"""The documentation site: its configuration reference is the code's, every key is
described, and ``mkdocs build --strict`` passes (no broken link, no page left out)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sampan.cli import reference as cli_reference
from sampan.config.reference import COMMAND, markdown, missing_descriptions

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_key_has_a_description():
    assert missing_descriptions() == []


def test_the_config_reference_page_is_the_codes():
    page = ROOT / "docs" / "reference" / "config.md"
    assert page.read_text() == markdown(), f"the reference is out of date: run `{COMMAND}`"


def test_the_command_line_reference_page_is_the_codes():
    page = ROOT / "docs" / "reference" / "cli.md"
    text = cli_reference.markdown()
    assert page.read_text() == text, f"out of date: run `{cli_reference.COMMAND}`"
    # every command, its options with their types and defaults, examples as shell blocks
    for cmd in ("sampan train", "sampan serve", "sampan experiment ope", "sampan data inspect"):
        assert f"## `{cmd}`" in text
    assert "| `--nproc-per-node` | int >= 1 | 1 |" in text and "```bash\nsampan train" in text


def test_the_rest_reference_page_is_the_codes_and_every_field_is_described():
    pytest.importorskip("fastapi")
    from sampan.serving import reference as rest

    page = ROOT / "docs" / "reference" / "rest.md"
    assert page.read_text() == rest.markdown(), f"out of date: run `{rest.COMMAND}`"
    schemas = rest.openapi()["components"]["schemas"]
    bare = [f"{n}.{f}" for n, s in schemas.items() if not n.endswith("ValidationError")
            for f, p in s.get("properties", {}).items() if not p.get("description")]
    assert bare == []
    text = page.read_text()
    for route in ("POST /v1/rank", "POST /v1/feedback", "POST /v1/admin/weights"):
        assert f"## `{route}`" in text


def test_the_reference_names_types_defaults_and_ranges():
    text = markdown()
    # a nested list section, a literal, a range and a required key, as the models say
    assert "### `data.joins[]`" in text and "### `model: din`" in text
    assert '| `format` | "auto" \\| "csv"' in text
    assert "| `epochs` | int \\| \"auto\" | \"auto\" |" in text
    assert "| `embedding_dim` | int | 16 | > 0 |" in text
    assert "| `features` | section | required |" in text


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                        for m in ("mkdocs", "material", "mkdocstrings")),
                    reason="needs the docs extra (pip install -e '.[docs]')")
def test_the_site_builds_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    api = (tmp_path / "site" / "reference" / "python" / "index.html").read_text()
    assert "from_yaml" in api and "feedback" in api  # the docstrings, rendered
    assert ":meth:" not in api and ":class:" not in api  # their roles as plain code


def test_the_readme_config_is_the_shipped_one_and_loads():
    """The README's "One config" block is configs/quickstart_ml100k.yaml, which loads."""
    import re

    import yaml

    from sampan.config import load_config

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## One config.*?```yaml\n(.*?)```", readme, re.S).group(1)
    shipped = ROOT / "configs" / "quickstart_ml100k.yaml"
    assert yaml.safe_load(block) == yaml.safe_load(shipped.read_text())
    assert load_config(shipped).model.name == "deepfm"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
