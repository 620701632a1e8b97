"""The exported graph: transformed tensors in, probabilities out.

Inputs, in this order and with these names: ``dense [B, Nd] float32``, ``sparse [B, F]
int64``, then one ``[B, L] int64`` input per list feature of the schema (named after it).
Output: ``probabilities [B, T] float32`` (the sigmoid of the logits; for ``two_tower`` the
sigmoid of the scaled cosine of the pair).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from sampan.batch import Batch
from sampan.bundle import input_names
from sampan.schema import DataSchema


class ScoringGraph(nn.Module):
    """Wraps a model so that it takes positional tensors instead of a :class:`Batch`.

    ``head="probabilities"`` returns the sigmoid of the logits; ``head="user_vectors"`` the
    user tower of a retrieval model (``[B, d]``, for the ANN search of ``/v1/recommend``).
    """

    def __init__(self, model: nn.Module, schema: DataSchema, head: str = "probabilities"):
        super().__init__()
        self.model = model
        self.head = head
        self.lists = [s.name for s in schema.sequences]

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor,
                *lists: torch.Tensor) -> torch.Tensor:
        batch = Batch(dense=dense, sparse=sparse,
                      sequences=dict(zip(self.lists, lists, strict=True)) or None)
        if self.head == "user_vectors":
            return self.model.user_vectors(batch).float()
        return torch.sigmoid(self.model(batch).float())


def example_inputs(batch: Batch, schema: DataSchema) -> tuple[torch.Tensor, ...]:
    seqs = batch.sequences or {}
    return (batch.dense.float(), batch.sparse.long(),
            *[seqs[s.name].long() for s in schema.sequences])


def to_onnx(model: nn.Module, schema: DataSchema, example: Batch, path: Path,
            head: str = "probabilities") -> Path:
    """Export with ``torch.onnx`` (the ``torch.export`` based exporter), batch dimension
    dynamic. The oneDNN fast path of :class:`sampan.layers.Linear` turns itself off while
    exporting, so the graph holds standard ONNX ops only."""
    graph = ScoringGraph(model, schema, head).eval()
    inputs = example_inputs(example, schema)
    if inputs[0].shape[0] < 2:  # torch.export fixes a dimension of size 1 (a stream's last
        inputs = tuple(torch.cat([t, t]) for t in inputs)  # window may hold one row)
    batch_dim = torch.export.Dim("batch", min=1)
    n_lists = len(schema.sequences)
    # not the user's concern: "torchvision is not installed", and the graph optimizer's
    # "Skipping constant folding for op Split with multiple outputs" (a multi-task head)
    quiet = [logging.getLogger(name) for name in (
        "torch.onnx._internal.exporter._registration",
        "onnxscript.optimizer._constant_folding")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    # a failed torch.export prints its graphs to stderr (and symbolic shapes a warning):
    # held back, and said in one line instead (_export_failure); written out on success
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    drop, held = _DropAll(), io.StringIO()
    shapes.addFilter(drop)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(held):
            warnings.simplefilter("ignore")  # nor is the exporter's deprecation chatter
            torch.onnx.export(
                graph, inputs, str(path),
                input_names=input_names(schema), output_names=[head],
                dynamic_shapes=({0: batch_dim}, {0: batch_dim}) + (
                    (tuple({0: batch_dim} for _ in range(n_lists)),) if n_lists else ()),
                dynamo=True, verbose=False, optimize=True)
    except torch.onnx.OnnxExporterError as e:
        raise _export_failure(type(model).__name__, e) from e
    else:
        sys.stderr.write(held.getvalue())
    finally:
        shapes.removeFilter(drop)
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    _check_batch_dim(path)
    return path


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _export_failure(name: str, error: BaseException) -> Exception:
    """What stopped the exporter, said in a line: the root cause and the line of the
    model's own code it was running (the exporter's message is a page of its internals)."""
    import traceback

    from sampan.errors import ExportError

    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    torch_dir = str(Path(torch.__file__).parent)
    ours = str(Path(__file__).resolve().parents[1])
    frames = [f for f in traceback.extract_tb(cause.__traceback__)
              if not f.filename.startswith((torch_dir, ours)) and "site-packages" not in
              f.filename and not f.filename.startswith("<")]
    at = f" at {frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" \
        if frames else ""
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    hint = ""
    if "data-dependent" in str(cause) or type(cause).__name__.startswith("GuardOnData"):
        hint = ("; Python control flow on a tensor's values (an if on it) cannot be traced "
                "into a graph: write it with tensor operations such as torch.where")
    return ExportError(f"{name} cannot be exported to ONNX: torch.export stopped{at}: "
                       f"{type(cause).__name__}: {text}{hint}")


def _check_batch_dim(path: Path) -> None:
    """Fail when the exporter fixed the batch size (a shape test in the model's code
    specialises it): such a graph refuses every request of another size."""
    import onnx

    from sampan.errors import ExportError

    model = onnx.load(str(path), load_external_data=False)
    fixed = [(i.name, i.type.tensor_type.shape.dim[0].dim_value) for i in model.graph.input
             if not i.type.tensor_type.shape.dim[0].dim_param]
    if fixed:
        raise ExportError(f"the exported graph {path.name} takes a fixed batch size "
                          f"({fixed[0][0]}: {fixed[0][1]} rows), not any number of rows; "
                          "this is a bug in the model's code (a branch on a tensor's size)")


def to_torchscript(model: nn.Module, schema: DataSchema, example: Batch, path: Path) -> Path:
    """Trace to TorchScript (``torch.jit.load`` serves it without Sampan installed)."""
    graph = ScoringGraph(model, schema).eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(graph, example_inputs(example, schema), check_trace=False)
    traced.save(str(path))
    return path
