"""Checkpoints carry a sha256 trailer, checked on load (issue 13): a flipped byte, a
truncated, empty or foreign file is a CheckpointError naming the file, never different
weights; a failed write leaves no temporary file and keeps the previous checkpoint."""

import os

import pytest
import torch

from sampan.errors import CheckpointError, SampanError
from sampan.train import checkpoint as ckpt


@pytest.fixture
def saved(tmp_path):
    obj = {"model": {"emb.weight": torch.randn(500, 8)}, "step": 7,
           "optim": {"exp_avg": torch.randn(500, 8)}}
    path = tmp_path / "best.pt"
    ckpt.save_atomic(obj, path)
    return path, obj


def test_round_trip(saved):
    path, obj = saved
    got = ckpt.load(path)
    assert got["step"] == 7 and torch.equal(got["model"]["emb.weight"],
                                            obj["model"]["emb.weight"])


@pytest.mark.parametrize("where", [0.3, 0.5, 0.9])
def test_flipped_bytes_are_refused(saved, where):
    path, _ = saved
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    for i in range(at, at + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt") as e:
        ckpt.load(path)
    assert str(path) in str(e.value)


def test_truncated_empty_and_foreign_files_are_refused(saved, tmp_path):
    path, obj = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="checksum"):
        ckpt.load(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        ckpt.load(path)
    foreign = tmp_path / "foreign.pt"
    torch.save(obj, foreign)  # a valid torch file, but not written by Sampan
    with pytest.raises(CheckpointError, match="not written by Sampan"):
        ckpt.load(foreign)
    assert issubclass(CheckpointError, SampanError)


def test_a_failed_write_keeps_the_old_checkpoint_and_no_temp_file(saved, monkeypatch):
    path, obj = saved
    before = path.read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        ckpt.save_atomic({**obj, "step": 8}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["best.pt"]
