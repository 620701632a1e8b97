"""Binary classification (CTR): one sigmoid cross-entropy per label, averaged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sampan.train.metrics import MetricAccumulator


def binary_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE-with-logits over ``[B, T]``; computed in float32 even under autocast."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class BinaryTask:
    """Loss: BCE per label (+ the model's auxiliary loss). Metrics: AUC, LogLoss, GAUC when
    the data has groups, and per-label AUC / LogLoss for several labels."""

    name = "binary"
    default_metric = "auc"

    def training_rows(self, train: Any) -> Any:
        return train

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        from sampan.tasks import pop_aux_loss

        loss = binary_loss(model(batch), batch.labels)
        aux = pop_aux_loss(model)
        return loss if aux is None else loss + aux

    def evaluate(self, model: nn.Module, data: Any,
                 infer: Callable[[Callable, Any], torch.Tensor]) -> dict[str, float]:
        z = infer(model, data)
        acc = MetricAccumulator()
        if len(z):
            acc.update(z, torch.from_numpy(np.array(data.labels, dtype=np.float32)),
                       None if data.group is None else torch.from_numpy(np.array(data.group)))
        return acc.compute()
