"""Shared fixtures: tiny experiment configs and the location of the real datasets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SAMPAN_SHARED_DATA", ROOT.parent / "shared" / "data"))


def tiny_config(tmp_path: Path, rows: int = 3000, **train) -> dict:
    """A raw config dict: DeepFM on a few thousand synthetic rows, quick on 2 cores.

    Without the first-order warm start (an LR fitted before the model): these configs test
    the mechanics of a run, and the warm start has its own tests (test_warm_start.py)."""
    return {
        "name": "tiny",
        "preset": "criteo",
        "output_dir": str(tmp_path / "runs"),
        "data": {"format": "synthetic", "synthetic": {"rows": rows},
                 "split": {"train": 0.8, "valid": 0.1, "test": 0.1}},
        "model": {"name": "deepfm", "embedding_dim": 4, "mlp": [16]},
        "train": {"epochs": 2, "batch_size": 256, "progress": False, "tensorboard": False,
                  "prefetch": 1, "first_order_warm_start": False, **train},
    }


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets not present at {SHARED_DATA}")
    return SHARED_DATA
