"""Tasks: what a model is trained for (its loss) and how it is evaluated.

Models only return outputs; the task turns them into a loss and metrics. A model class names
its task with a ``task`` attribute (``"binary"`` when absent): CTR, sequence and multi-task
models are ``binary`` (one sigmoid cross-entropy per label), ``two_tower`` is ``retrieval``
(in-batch sampled softmax; Recall/NDCG@K over the item corpus), ``sasrec`` is ``next_item``
(softmax over the catalogue at every position of the history; HitRate/NDCG@K and MRR of
the next item ranked against every item).

The contract between them is declared in :mod:`sampan.tasks.base` (:class:`Task`,
:class:`RetrievalModel`, ``forward_with_aux`` for an auxiliary loss) and checked when the
task is made.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sampan.errors import ConfigError
from sampan.tasks.base import NextItemModel, RetrievalModel, Task, model_outputs, require
from sampan.tasks.binary import BinaryTask, binary_loss


def make_task(model: nn.Module, train: Any = None) -> Task:
    """The task object for ``model``, checked against the model contract of its task;
    ``train`` (a SplitArrays) is needed by retrieval (item corpus, popularity, already-seen
    items)."""
    kind = getattr(model, "task", "binary")
    if kind == "binary":
        return BinaryTask()
    if kind == "retrieval":
        from sampan.tasks.retrieval import RetrievalTask

        require(model, RetrievalModel)
        if train is None:
            raise ValueError("a retrieval task needs the train split (the item corpus)")
        return RetrievalTask(model, train)
    if kind == "next_item":
        from sampan.tasks.next_item import NextItemTask

        require(model, NextItemModel)
        if train is None:
            raise ValueError("a next-item task needs the train split (item popularity)")
        return NextItemTask(model, train)
    raise ConfigError(f"model {type(model).__name__} declares unknown task {kind!r}; "
                      "expected 'binary', 'retrieval' or 'next_item'")


def training_loss(model: nn.Module, batch: Any, task: Any = None) -> torch.Tensor:
    """The loss the trainer minimises on ``batch`` (task loss plus any auxiliary loss)."""
    return (task or make_task(model)).loss(model, batch)


__all__ = ["BinaryTask", "NextItemModel", "RetrievalModel", "Task", "binary_loss", "make_task",
           "model_outputs", "training_loss"]
