"""Binary classification (CTR): one sigmoid cross-entropy per task, averaged."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def binary_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE-with-logits over ``[B, T]``; computed in float32 even under autocast."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
