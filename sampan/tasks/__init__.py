"""Tasks: what a model is trained for (its loss) and how it is evaluated.

Models only return outputs; the task turns them into a loss and metrics. A model class names
its task with a ``task`` attribute (``"binary"`` when absent): CTR, sequence and multi-task
models are ``binary`` (one sigmoid cross-entropy per label), ``two_tower`` is ``retrieval``
(in-batch sampled softmax; Recall/NDCG@K over the item corpus).

A model may also leave an auxiliary loss (DIEN's next-behaviour loss) in ``model.aux_loss``
during its training forward; :func:`pop_aux_loss` hands it to the task's loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sampan.tasks.binary import BinaryTask, binary_loss


def pop_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The auxiliary loss the last training forward left on ``model`` (cleared on read)."""
    aux = getattr(model, "aux_loss", None)
    if aux is not None:
        model.aux_loss = None
    return aux


def make_task(model: nn.Module, train: Any = None) -> Any:
    """The task object for ``model``; ``train`` (a SplitArrays) is needed by retrieval (item
    corpus, popularity, already-seen items)."""
    kind = getattr(model, "task", "binary")
    if kind == "binary":
        return BinaryTask()
    if kind == "retrieval":
        from sampan.tasks.retrieval import RetrievalTask

        if train is None:
            raise ValueError("a retrieval task needs the train split (the item corpus)")
        return RetrievalTask(model, train)
    raise ValueError(f"model {type(model).__name__} declares unknown task {kind!r}; "
                     "expected 'binary' or 'retrieval'")


def training_loss(model: nn.Module, batch: Any, task: Any = None) -> torch.Tensor:
    """The loss the trainer minimises on ``batch`` (task loss plus any auxiliary loss)."""
    return (task or make_task(model)).loss(model, batch)


__all__ = ["BinaryTask", "binary_loss", "make_task", "pop_aux_loss", "training_loss"]
