"""A CPU training run keeps the memory its steps free for the next step's tensors
(``train.reuse_memory``), instead of glibc's malloc handing large blocks back to the kernel
and faulting them in again page by page, every step."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

# DCNv2 steps at batch 2048 (activations 2048 x 429 floats, 3.5 MB), in a Python of their
# own: the malloc settings are for the whole process.
SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np, torch
    from sampan.config import ExperimentConfig
    from sampan.data.loader import BatchLoader
    from sampan.data.store import SplitArrays
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SparseFeatureSpec
    from sampan.train.trainer import Trainer

    fields = [f"c{i}" for i in range(26)]
    schema = DataSchema(dense=[f"x{i}" for i in range(13)],
                        sparse=[SparseFeatureSpec(c, 1000) for c in fields])
    g = np.random.default_rng(0)
    rows = SplitArrays(dense=g.random((8192, 13), dtype=np.float32),
                       sparse=g.integers(0, 1000, (8192, 26)),
                       labels=(g.random((8192, 1)) < 0.3).astype(np.float32))
    cfg = ExperimentConfig.model_validate({
        "features": {"categorical": fields, "numeric": schema.dense},
        "model": {"name": "dcn_v2", "embedding_dim": 16, "mlp": [400, 400]},
        "train": {"device": "cpu", "reuse_memory": sys.argv[1] == "on", "batch_size": 2048,
                  "kernels": "mkl", "amp": "none", "progress": False, "tensorboard": False}})
    model = build_model(get_model_class("dcn_v2").Config(**cfg.model.model_dump()), schema)
    trainer = Trainer(model, cfg, sys.argv[2], rows, None, log_metrics=False)
    batches = list(BatchLoader(rows, 2048, prefetch=0))
    for b in batches[:2]:
        trainer._train_step(b)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2):
        for b in batches:
            trainer._train_step(b)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8
    print(faults, "reuse_memory" in trainer.plan.reasons)
""")


@pytest.mark.parametrize("setting", ["on", "off"])
def test_a_cpu_run_reuses_the_memory_its_steps_free(setting, tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    faults, said = out.split()[-2:]
    # measured on 2 cores: 100 to 220 a step with it, 10,000 to 11,000 without
    if setting == "on":
        assert float(faults) < 1500 and said == "True", out
    else:  # train.reuse_memory: false leaves glibc's defaults, and their page faults
        assert float(faults) > 4000 and said == "False", out
