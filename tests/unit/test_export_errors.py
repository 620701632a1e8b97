"""A model the ONNX exporter cannot trace fails in one line that names its own code."""

import pytest
import torch
from torch import nn

from sampan.batch import Batch
from sampan.schema import DataSchema, SparseFeatureSpec


class Branchy(nn.Module):
    """Python control flow on a tensor's value: fine in PyTorch, no graph to export."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 1)

    def forward(self, batch):
        out = self.emb(batch.sparse).sum(1) + batch.dense
        if out.mean() > 0:  # the line the error names
            return out + 1
        return out - 1


def test_a_model_the_exporter_cannot_trace_is_one_line_naming_its_own_code(tmp_path):
    from sampan.errors import ExportError
    from sampan.export.graph import to_onnx

    schema = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5)])
    example = Batch(dense=torch.ones(4, 1), sparse=torch.ones(4, 1, dtype=torch.long))
    with pytest.raises(ExportError) as e:
        to_onnx(Branchy(), schema, example, tmp_path / "m.onnx")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Branchy cannot be exported to ONNX")
    assert f"{__file__}:" in msg and "if out.mean() > 0:" in msg
    assert "torch.where" in msg
