"""The contract between a task and a model, declared rather than guessed.

A **task** (:class:`Task`) turns a model's outputs into a loss and metrics. A **model**
declares which task it trains for with its class attribute ``task`` (``"binary"`` when
absent) and meets that task's model contract:

* every model: ``forward(batch) -> logits [B, T]``;
* a model with an auxiliary loss (DIEN's next-behaviour loss) also defines
  ``forward_with_aux(batch) -> (logits [B, T], aux loss or None)``; the task adds the
  auxiliary loss in training, and ``forward`` stays the scoring graph (evaluation, export);
* a ``retrieval`` model is a :class:`RetrievalModel`;
* a ``next_item`` model is a :class:`NextItemModel`.

:func:`require` checks a model against its task's contract once, when the task is made,
and names what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from sampan.errors import ConfigError


@runtime_checkable
class Task(Protocol):
    """What the Trainer and the Evaluator need from a task."""

    name: str
    default_metric: str  # what early stopping follows unless the config names one

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, data: Any,
                 infer: Callable[[Callable, Any], torch.Tensor]) -> dict[str, float]: ...

    def training_rows(self, data: Any) -> Any: ...

    def reference_loss(self, train: Any, batch_size: int) -> float: ...

    def init_output_bias(self, model: nn.Module, train: Any, device: Any) -> str | None: ...


@runtime_checkable
class RetrievalModel(Protocol):
    """What the retrieval task reads from a two-tower model."""

    k: int
    exclude_seen: bool
    temperature: float
    logq_correction: bool
    item_column: int
    user_column: int
    item_cardinality: int
    user_cardinality: int

    def user_vectors(self, batch: Any) -> torch.Tensor: ...

    def item_vectors(self, batch: Any) -> torch.Tensor: ...

    def vectors(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


def model_outputs(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logits, auxiliary loss or None)`` of a training forward."""
    with_aux = getattr(model, "forward_with_aux", None)
    if with_aux is not None:
        return with_aux(batch)
    return model(batch), None


def require(model: nn.Module, contract: type) -> None:
    """Raise :class:`ConfigError` naming what ``model`` lacks of ``contract`` (a Protocol)."""
    members = [m for m in getattr(contract, "__annotations__", {})] + [
        m for m, v in vars(contract).items() if callable(v) and not m.startswith("_")]
    missing = [m for m in dict.fromkeys(members) if not hasattr(model, m)]
    if missing:
        raise ConfigError(f"model {type(model).__name__} declares task "
                          f"{getattr(model, 'task', 'binary')!r} but lacks {missing} "
                          f"(see {contract.__module__}.{contract.__name__})")


@runtime_checkable
class NextItemModel(Protocol):
    """What the next-item task reads from a sequential model (SASRec)."""

    history: str
    target_column: int
    item_cardinality: int
    loss_kind: str
    negatives: int
    k: int
    exclude_history: bool

    def encode(self, seq: torch.Tensor) -> torch.Tensor: ...

    def user_state(self, batch: Any) -> torch.Tensor: ...

    def item_vectors(self, ids: torch.Tensor | None = None) -> torch.Tensor: ...
