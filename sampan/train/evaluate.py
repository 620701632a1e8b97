"""Scoring a model without a Trainer: inference over stored rows, logits, and the task's
metrics. The Trainer evaluates through one; ``sampan eval``, ``predict``, ``compare`` and
``export`` (through :class:`~sampan.train.experiment.RunArtifacts`) use one directly, with no
optimizer, training loader or run directory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from sampan.data.loader import BatchLoader
from sampan.data.store import SplitArrays
from sampan.distributed.context import context
from sampan.distributed.sharded_embedding import RowShardedCollection
from sampan.distributed.strategy import SingleProcess, strategy_for
from sampan.errors import SampanError


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when there is a GPU; under a distributed launch a CUDA device is
    the process's own GPU (``LOCAL_RANK``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SampanError(f"train.device={name!r} but CUDA is not available on this machine; "
                          "use train.device=cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SampanError(f"train.device={name!r} but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s): cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1}")
    if dev.type == "cuda" and dev.index is None and context().enabled:
        dev = torch.device("cuda", context().local_rank)
    return dev


class Evaluator:
    """``model`` scored under ``task`` on ``device``: batches of ``eval_batch_size`` rows in
    fp32 (as the exported model serves, whatever precision trained it), ``prefetch``
    batches ahead. Under a
    data-parallel ``strategy`` each process scores its share of the rows and every process
    gets all of them back, in order."""

    def __init__(self, model: nn.Module, task: Any, device: torch.device,
                 eval_batch_size: int = 16384, prefetch: int = 2,
                 strategy: SingleProcess | None = None):
        self.model, self.task, self.device = model, task, device
        self.eval_batch_size, self.prefetch = eval_batch_size, prefetch
        self.strategy = strategy or strategy_for()

    @torch.no_grad()
    def infer(self, fn, data: SplitArrays) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """``fn(batch)`` over every row of ``data`` in order (eval mode, no grad, fp32),
        concatenated on the CPU as float32."""
        self.model.eval()
        steps = None
        st = self.strategy
        if st.enabled:  # each rank scores a contiguous shard; rows come back in order
            lo, hi = st.shard(len(data))
            full, data = data, data.take(np.arange(lo, hi))
            if any(isinstance(m, RowShardedCollection) for m in self.model.modules()):
                # lookups are collective: every rank makes the same number of calls, a rank
                # out of rows scores filler rows and drops them
                bs = self.eval_batch_size
                steps = st.max_int(-(-len(data) // bs))
                filler = full.take(np.arange(min(bs, len(full))))
        out = []
        loader = BatchLoader(data, self.eval_batch_size, shuffle="none", prefetch=self.prefetch)
        batches = iter(loader)
        for i in range(len(loader) if steps is None else steps):
            keep = i < len(loader)
            batch = next(batches) if keep else next(iter(BatchLoader(
                filler, self.eval_batch_size, shuffle="none", prefetch=0)))
            batch = batch.to(self.device, non_blocking=True)
            y = fn(batch).float()
            if keep:
                out.append(y)
        if st.enabled:
            # the output width is needed even on a rank whose shard is empty
            width = st.max_int(out[0].shape[1] if out else -1)
            local = torch.cat(out) if out else torch.empty(0, width, device=self.device)
            return st.gather_rows(local).cpu()
        return torch.cat(out).cpu() if out else torch.empty(0, 1)

    def predict_logits(self, data: SplitArrays) -> torch.Tensor:
        """Logits ``[N, T]`` for every row of ``data``, in order."""
        return self.infer(self.model, data)

    def evaluate(self, data: SplitArrays) -> dict[str, float]:
        """The task's metrics of the model on ``data`` (binary: AUC, LogLoss and GAUC when
        groups exist; retrieval: Recall / NDCG @ K and a popularity baseline)."""
        return self.task.evaluate(self.model, data, self.infer)


def headline_metrics(m: dict[str, float]) -> list[str]:
    """The metric names worth printing from an evaluation, in a stable order."""
    keys = ["auc", "logloss", "gauc"] + [k for k in m if k.startswith("auc_")]
    ranked = [k for k in m if k.split("@")[0] in ("recall", "ndcg", "hitrate")]
    cutoffs = sorted({int(k.split("@")[1]) for k in ranked})
    # one cut-off is enough for a table: 10 when there are several
    at = 10 if 10 in cutoffs else cutoffs[-1] if cutoffs else None
    keys += [k for k in ranked if k.endswith(f"@{at}")] + ["mrr"]
    keys += [f"pop_recall@{at}" if f"pop_recall@{at}" in m else f"pop_ndcg@{at}"]
    return [k for k in keys if k in m]


def probabilities(logits: torch.Tensor) -> np.ndarray:
    return torch.sigmoid(logits.double()).cpu().numpy()
