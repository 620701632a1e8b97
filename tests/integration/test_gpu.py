"""GPU path: the same numbers as on CPU. Skipped on machines without CUDA."""

import pytest
import torch

from sampan.config import load_config
from sampan.embedding import EmbeddingCollection, SparseAdagrad, SparseAdam
from sampan.schema import TableSpec
from sampan.train.experiment import run_experiment
from tests.conftest import tiny_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("opt_cls", [SparseAdam, SparseAdagrad])
def test_sparse_optimizers_match_cpu(opt_cls):
    def train(device):
        torch.manual_seed(0)
        coll = EmbeddingCollection([TableSpec("a", 50, 8, ("a",)),
                                    TableSpec("b", 20, 8, ("b",))]).to(device)
        opt = opt_cls([coll], lr=0.05)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            ids = torch.stack([torch.randint(0, 50, (64,), generator=g),
                               torch.randint(0, 20, (64,), generator=g)], 1).to(device)
            coll(ids).square().sum().backward()
            opt.step()
        return coll.weight.detach().cpu()

    torch.testing.assert_close(train("cuda"), train("cpu"), rtol=1e-4, atol=1e-5)


def test_training_on_cuda_matches_cpu(tmp_path):
    out = {}
    for device in ("cpu", "cuda"):
        cfg = load_config(raw=tiny_config(tmp_path, rows=2000, device=device, epochs=1))
        out[device] = run_experiment(cfg, run_dir=tmp_path / device)
    assert out["cuda"]["test"]["auc"] == pytest.approx(out["cpu"]["test"]["auc"], abs=2e-3)


def test_bf16_on_cuda_trains(tmp_path):
    cfg = load_config(raw=tiny_config(tmp_path, rows=2000, device="cuda", amp="bf16"))
    assert run_experiment(cfg, run_dir=tmp_path / "bf16")["test"]["auc"] > 0.55


def test_dynamic_key_index_on_cuda_matches_cpu():
    import numpy as np

    from sampan.embedding.dynamic import KeyIndex

    g = np.random.default_rng(0)
    stream = [torch.from_numpy(g.zipf(1.2, 4096).astype(np.int64) * 7919) for _ in range(60)]
    out = {}
    for device in ("cpu", "cuda"):
        idx = KeyIndex(3000, min_count=2, policy="lfu", evict_fraction=0.05, device=device)
        rows = [idx.admit(b.to(device), s) for s, b in enumerate(stream)]
        out[device] = ([r.cpu() for r, _ in rows], [f.cpu() for _, f in rows],
                       idx.find(torch.cat(stream).to(device)).cpu())
    for a, b in zip(out["cpu"][0] + out["cpu"][1], out["cuda"][0] + out["cuda"][1],
                    strict=True):
        assert torch.equal(torch.sort(a).values, torch.sort(b).values)
    assert torch.equal(out["cpu"][2] > 0, out["cuda"][2] > 0)


def test_cuda_trained_model_exports_with_parity(tmp_path):
    """A model trained on the GPU exports to ONNX (run on the CPU by ONNX Runtime) and scores
    as it does on the GPU."""
    import json

    from sampan.export import export_run
    from sampan.train.experiment import RunArtifacts

    cfg = load_config(raw=tiny_config(tmp_path, rows=2000, device="cuda", epochs=1))
    results = run_experiment(cfg, run_dir=tmp_path / "run")
    bundle = export_run(tmp_path / "run", tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["parity"]["max_abs_diff"] <= 1e-5  # ONNX Runtime vs the weights on CPU
    art = RunArtifacts(tmp_path / "run")  # on the run's device: CUDA
    assert next(art.model.parameters()).is_cuda
    test = art.labelled("test")
    on_gpu = art.evaluator.predict_logits(test).float().cpu()
    art.model.cpu()  # the same weights, scored on the CPU
    art.evaluator.device = torch.device("cpu")
    torch.testing.assert_close(art.evaluator.predict_logits(test).float().cpu(), on_gpu,
                               rtol=1e-4, atol=1e-4)
    assert art.evaluate("test")["auc"] == pytest.approx(results["test"]["auc"], abs=1e-3)


def test_batches_gathered_on_cuda_are_the_host_batches():
    import numpy as np

    from sampan.data.arrays import SplitArrays
    from sampan.data.loader import BatchLoader

    rng = np.random.default_rng(0)
    data = SplitArrays(dense=rng.standard_normal((700, 3)).astype(np.float32),
                       sparse=rng.integers(0, 50, (700, 4)).astype(np.int32),
                       labels=rng.random((700, 1)).astype(np.float32))
    host = list(BatchLoader(data, 64, shuffle="rows", seed=1))
    dev = list(BatchLoader(data, 64, shuffle="rows", seed=1, device="cuda"))
    for a, b in zip(host, dev, strict=True):
        assert b.sparse.is_cuda
        assert torch.equal(a.sparse, b.sparse.cpu()) and torch.equal(a.dense, b.dense.cpu())
