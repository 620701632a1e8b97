"""Checkpoints in per-process parts: written by each row owner, read whole or by rows."""

import pytest
import torch

from sampan.distributed import shard_bounds
from sampan.train import checkpoint as ckpt


def write(path, table, state, step, world):
    """What `world` processes write: each its rows, then rank 0 the rest."""
    for rank in range(world):
        lo, hi = shard_bounds(len(table), world)[rank: rank + 2]
        ckpt.save_part({"model/emb.weight": table[lo:hi], "sparse_opt/0/sum": state[lo:hi]},
                       path, f"step{step}", rank, world)
    ckpt.save_with_parts({
        "model": {"emb.weight": ckpt.placeholder("model/emb.weight", len(table)),
                  "mlp.bias": torch.ones(3)},
        "sparse_opt": {"state": {0: {"sum": ckpt.placeholder("sparse_opt/0/sum", len(table)),
                                     "step": torch.tensor(7)}}, "param_groups": []},
        "state": {"step": step}}, path, f"step{step}", world)


def test_parts_read_whole_or_by_any_rows(tmp_path):
    table, state = torch.randn(23, 4), torch.rand(23)
    path = tmp_path / "last.pt"
    write(path, table, state, step=5, world=3)
    c = ckpt.load(path)
    assert torch.equal(c["model"]["emb.weight"], table)
    assert torch.equal(c["sparse_opt"]["state"][0]["sum"], state)
    assert c["sparse_opt"]["state"][0]["step"] == 7 and c["state"]["step"] == 5
    assert "parts" not in c
    # another world size: each of 2 (or 5) processes reads just its rows, across part edges
    for world in (2, 5):
        for rank in range(world):
            lo, hi = shard_bounds(23, world)[rank: rank + 2]

            def rows_of(key, total, lo=lo, hi=hi):
                assert total == 23
                return (lo, hi) if key.startswith(("model/emb", "sparse_opt/0")) else None

            c = ckpt.load(path, rows_of=rows_of)
            assert torch.equal(c["model"]["emb.weight"], table[lo:hi])
            assert torch.equal(c["sparse_opt"]["state"][0]["sum"], state[lo:hi])
            assert torch.equal(c["model"]["mlp.bias"], torch.ones(3))


def test_a_newer_checkpoint_removes_older_parts_and_missing_parts_are_named(tmp_path):
    path = tmp_path / "last.pt"
    table = torch.randn(10, 2)
    write(path, table, torch.rand(10), step=5, world=2)
    write(tmp_path / "best.pt", table, torch.rand(10), step=5, world=2)
    write(path, table * 2, torch.rand(10), step=9, world=2)
    names = sorted(p.name for p in tmp_path.glob("*.part*"))
    assert names == ["best.step5.part0-of-2.pt", "best.step5.part1-of-2.pt",
                     "last.step9.part0-of-2.pt", "last.step9.part1-of-2.pt"]
    assert torch.equal(ckpt.load(path)["model"]["emb.weight"], table * 2)
    (tmp_path / "last.step9.part1-of-2.pt").unlink()
    with pytest.raises(FileNotFoundError, match="missing its parts.*last.step9.part1-of-2"):
        ckpt.load(path)


def test_a_part_is_saved_compact(tmp_path):
    """A row range read memory-mapped from a bigger part is saved as its rows alone."""
    big = torch.randn(10_000, 8)
    write(tmp_path / "last.pt", big, torch.rand(10_000), step=1, world=2)
    rows = ckpt.load(tmp_path / "last.pt", rows_of=lambda key, n: (5000, 5100))
    ckpt.save_part({"model/emb.weight": rows["model"]["emb.weight"]}, tmp_path / "x.pt",
                   "step2", 0, 1)
    assert (tmp_path / "x.step2.part0-of-1.pt").stat().st_size < 20_000
    got = torch.load(tmp_path / "x.step2.part0-of-1.pt", weights_only=True)["rows"]
    assert torch.equal(got["model/emb.weight"], big[5000:5100])


def test_remove_parts_keeps_only_the_named(tmp_path):
    table = torch.randn(6, 2)
    write(tmp_path / "last.pt", table, torch.rand(6), step=3, world=2)
    ckpt.remove_parts(tmp_path / "last.pt", keep=["last.step3.part1-of-2.pt"])
    assert [p.name for p in tmp_path.glob("*.part*")] == ["last.step3.part1-of-2.pt"]
    ckpt.remove_parts(tmp_path / "last.pt")
    assert not list(tmp_path.glob("*.part*"))
