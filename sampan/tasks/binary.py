"""Binary classification (CTR): one sigmoid cross-entropy per label, averaged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sampan.data.loader import BatchLoader
from sampan.metrics import MetricAccumulator
from sampan.tasks.base import model_outputs


def binary_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE-with-logits over ``[B, T]``; computed in float32 even under autocast."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class BinaryTask:
    """Loss: BCE per label (+ the model's auxiliary loss). Metrics: AUC, LogLoss, GAUC when
    the data has groups, and per-label AUC / LogLoss for several labels."""

    name = "binary"
    default_metric = "auc"

    @staticmethod
    def base_rates(data: Any) -> np.ndarray:
        """The share of positives of each label ``[T]``, clipped to (1e-4, 1 - 1e-4)."""
        y = np.asarray(data.labels, dtype=np.float64)
        return np.clip(y.mean(axis=0), 1e-4, 1 - 1e-4)

    def reference_loss(self, train: Any, batch_size: int) -> float:
        """The LogLoss of predicting each label's base rate (what a model that learned
        nothing scores); the divergence guard measures the training loss against it."""
        p = self.base_rates(train)
        return float(np.mean(-(p * np.log(p) + (1 - p) * np.log(1 - p))))

    @torch.no_grad()
    def init_output_bias(self, model: nn.Module, train: Any, device: Any) -> str | None:
        """Shift the model's ``output_bias()`` so that its mean logit on (up to) 4,096
        training rows is each label's base-rate logit; returns what it did, or ``None`` for
        a model that declares no output bias."""
        terms = model.output_bias() if hasattr(model, "output_bias") else []
        if not terms or len(train) == 0:
            return None
        p = self.base_rates(train)
        if len(terms) != len(p):
            raise ValueError(f"{type(model).__name__}.output_bias() names {len(terms)} "
                             f"outputs for {len(p)} labels")
        rows = np.linspace(0, len(train) - 1, min(len(train), 4096)).astype(np.int64)
        batch = next(iter(BatchLoader(train.take(np.unique(rows)), 4096, shuffle="none",
                                      prefetch=0))).to(device)
        was = model.training
        model.eval()
        mean = model(batch).float().mean(dim=0).cpu().numpy()
        model.train(was)
        target = np.log(p / (1 - p))
        for (param, i), m, t in zip(terms, mean, target, strict=True):
            param[i] += float(t - m)
        return "output bias at the base rate " + ", ".join(f"{x:.4f}" for x in p)

    def training_rows(self, train: Any) -> Any:
        return train

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        logits, aux = model_outputs(model, batch)
        loss = binary_loss(logits, batch.labels)
        return loss if aux is None else loss + aux

    def evaluate(self, model: nn.Module, data: Any,
                 infer: Callable[[Callable, Any], torch.Tensor]) -> dict[str, float]:
        z = infer(model, data)
        acc = MetricAccumulator()
        if len(z):
            acc.update(z, torch.from_numpy(np.array(data.labels, dtype=np.float32)),
                       None if data.group is None else torch.from_numpy(np.array(data.group)))
        return acc.compute()
