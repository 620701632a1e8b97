"""The ``train`` section: budget, optimizers, schedule, early stopping, divergence guard,
devices."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import (
    Field,
    field_validator,
)

from sampan.config.base import Auto, NonNegFloat, NonNegInt, PosFloat, PosInt, _Strict

# ---------------------------------------------------------------------------------- train


def known_metric(v: str | None) -> str | None:
    """``v`` when it names a validation metric Sampan computes (whether the experiment's
    model reports it is checked with the whole config); else a ValueError listing them."""
    if v is None or v in ("auc", "logloss", "gauc", "mrr") or re.fullmatch(
            r"(recall|ndcg|hitrate)@[1-9][0-9]*", v):
        return v
    raise ValueError(f"unknown metric {v!r}; expected auc, logloss, gauc, mrr, or "
                     "recall@K / ndcg@K / hitrate@K")


class EarlyStoppingConfig(_Strict):
    metric: str | None = Field(
        None, description="validation metric to track: auc, logloss, gauc, or for retrieval "
        "recall@K, ndcg@K, hitrate@K, mrr (K = the model's k); default: auc (logloss when the "
        "validation split holds under 100 positives or negatives, where AUC is too noisy to "
        "steer by), or recall@K for retrieval models")
    patience: PosInt | Literal["auto"] = Field(
        "auto", description="evaluations without improvement before stop; auto: two epochs' "
        "worth (2 with one evaluation per epoch, 8 with four), ten for next-item models")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str | None) -> str | None:
        return known_metric(v)
    min_delta: float = Field(1e-4, ge=0.0, description="the least change of the metric, in "
                             "its own units, that counts as an improvement")
    enabled: bool = Field(True, description="false: running out of patience does not end the "
                          "run (the best evaluation's weights are still the ones kept)")


class TrainConfig(_Strict):
    """The training loop: optimisation, schedule, evaluation, checkpoints.

    ``auto`` values are sized from the training rows when training starts (see
    :func:`sampan.train.plan.plan_training`); the run prints what was chosen and why and
    writes it to ``schedule.json``. An explicit value always wins.
    """

    epochs: PosInt | Auto = Field("auto", description="auto: until validation stops improving "
                               "(early stopping), at most the epochs that give 30,000 steps "
                               "(3 to 30)")
    max_steps: int | None = Field(None, gt=0, description="stop after this many optimizer "
                                  "steps (or at the end of epochs, if sooner), the span the "
                                  "schedule decays over; null: epochs alone")
    batch_size: PosInt | Auto = Field("auto", description="auto: the power of two nearest "
                                   "sqrt(train rows), 64 to 4096")
    eval_batch_size: int = Field(16384, gt=0, description="rows per batch when scoring "
                                 "validation, test or prediction rows")
    optimizer: Literal["adam", "adamw", "sgd"] = Field(
        "adam", description="optimizer of the dense (non-embedding) parameters; sgd uses "
        "momentum")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd: the dense optimizer's "
                            "momentum (0: plain SGD)")
    lr: float = Field(1e-3, gt=0, allow_inf_nan=False,
                      description="base learning rate of the dense parameters, and of the "
                      "embedding rows unless sparse_lr is set")
    weight_decay: float = Field(0.0, ge=0.0, description="weight decay of the dense optimizer "
                                "(added to the gradient for adam and sgd, decoupled for "
                                "adamw); embedding rows use embedding_l2")
    sparse_optimizer: Literal["adam", "adam_table", "adagrad", "rowwise_adagrad", "sgd"] = Field(
        "adam", description="embedding rows: adam (lazy, each row's bias correction counts "
        "its own updates), adam_table (one step counter per table: torch.optim.SparseAdam), "
        "adagrad, rowwise_adagrad, sgd (plain: w -= lr g)")
    sparse_lr: float | None = Field(None, gt=0, allow_inf_nan=False,
                                    description="defaults to lr")
    embedding_l2: NonNegFloat | Auto = Field(
        "auto", description="L2 on embedding rows used in a batch; auto: 0.1 / batch_size, "
        "the same regularisation per example at every batch size")
    embedding_l1: NonNegFloat = Field(
        0.0, description="L1 on embedding rows used in a batch: after each step they move "
        "toward 0 by this times the sparse learning rate and stop there (a proximal step, "
        "so ids without evidence end at exactly 0); 0: none")
    schedule: Literal["constant", "cosine", "plateau"] = Field(
        "cosine", description="after linear warmup: constant, a half cosine to min_lr_ratio "
        "at the last step, or plateau: constant, halved at every evaluation that does not "
        "improve the early-stopping metric")
    warmup_steps: NonNegInt | Auto = Field("auto", description="auto: a tenth of an epoch, 10 to "
                                     "200 steps")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine schedule: the "
                                "learning rate at the last step, as a fraction of the base")
    clip_grad_norm: float | None = Field(None, gt=0, description="clip the dense parameters' "
                                         "gradients to this total L2 norm (embedding rows are "
                                         "not clipped); null: no clipping")
    eval_every_steps: PosInt | Auto | None = Field(
        "auto", description="None: once per epoch; auto: once per epoch, or four times per "
        "epoch (at least 100 steps apart) when epochs are long")
    early_stopping: EarlyStoppingConfig = Field(
        EarlyStoppingConfig(), description="stop when the validation metric stops improving: "
        "which metric, how patient")
    on_divergence: Literal["recover", "stop"] = Field(
        "recover", description="a non-finite or exploding training loss, or a validation "
        "LogLoss far above the base rate's: recover restores the last good state and halves "
        "the learning rates (at most 3 times), stop ends the run with an error")
    init_output_bias: bool = Field(True, description="start the output bias at the training "
                                   "base rate's logit")
    first_order_warm_start: bool | Auto = Field(
        "auto", description="fit a logistic regression on the same rows first and start the "
        "model from it: its first-order terms (lr, whose whole model it is, fm, deepfm, "
        "wide_deep, xdeepfm, fibinet, autoint, dcn_v2 with first_order), or for dcn and "
        "dcn_v2 the first column of each id's vector, read by the output layer through "
        "crosses that start at zero; auto: on when there is a validation split")
    first_order_solver: Literal["auto", "lbfgs", "sgd"] = Field(
        "auto", description="how the warm start fits its LR: lbfgs, the exact L2-regularised "
        "optimum over all training rows with C chosen on validation; sgd, mini-batches until "
        "validation stops improving; auto: lbfgs when one process holds the rows' ids in "
        "memory (fitted vocabularies, a binary task), else sgd")
    first_order_frozen: bool = Field(
        True, description="after an exact (lbfgs) warm start, the ids' first-order weights "
        "keep the LR's values and only the rest of the model trains (an SGD start's, and the "
        "lr model's, keep training); false: they train with the rest")
    first_order_seconds: PosFloat | Auto | None = Field(
        "auto", description="the warm start's time budget in seconds: past it the exact "
        "fit keeps the best C found so far and an SGD fit stops at its next evaluation; auto: "
        "for an exact fit a third of the main training's estimated time (three steps "
        "timed), at least 3 s, and none where its design holds at most 2M ids (it takes "
        "seconds anyway); none for an SGD fit (its early stopping bounds it, in steps) "
        "or the lr model (its exact fit is the model); null: no bound, so that the warm "
        "start, and the run, never depend on the machine's speed")
    checkpoint_every_steps: int | None = Field(
        None, gt=0, description="write checkpoints/last.pt every this many steps too (it is "
        "always written at each epoch's end); null: at epoch ends only")
    shuffle: Literal["rows", "blocks", "none"] = Field(
        "rows", description="order of the training rows each epoch: rows permutes them all, "
        "blocks permutes blocks of 65,536 contiguous rows (cheaper on data larger than "
        "memory), none keeps file order")
    amp: Literal["auto", "none", "bf16"] = Field(
        "auto", description="training precision of the dense layers. bf16: autocast to "
        "bfloat16, with float32 weights, embeddings and optimizer state (slower than float32 "
        "on CPUs without AMX or AVX512-BF16); none: float32; auto: bf16 on a CPU with AMX or "
        "AVX512-BF16 and on a GPU that supports it, unless the model trains worse in bf16, "
        "else float32. Evaluation, export and serving are float32 either way")
    compile: bool = Field(False, description="torch.compile the dense layers (not the "
                          "embedding lookup); pays off on long runs")
    kernels: Literal["auto", "mkl", "onednn"] = Field(
        "auto", description="CPU GEMM library of the linear layers: auto times MKL and "
        "oneDNN for each of a layer's three GEMMs (forward, input and weight gradient) at its "
        "shape on this machine (cached) and takes the faster for each; mkl or onednn forces "
        "one for all")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                        description="auto | cpu | cuda | cuda:N")
    embedding_placement: Literal["auto", "replicated", "row_sharded"] = Field(
        "auto", description="distributed runs: replicate every fused table, shard each one's "
        "rows over the processes, or shard those of shard_min_bytes or more (auto)")
    shard_min_bytes: int = Field(256 << 20, ge=0, description="auto placement: tables this "
                                 "large (weights) are row-sharded")
    sync_batch_norm: bool = Field(True, description="distributed runs: batch norm "
                                  "statistics over the global batch (False: per process)")
    data_on_device: bool | Auto = Field(
        "auto", description="on a GPU: copy the training split to the device once and gather "
        "each batch there (no host gather or copy per step); auto: when the split takes under "
        "a quarter of the device's free memory")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads "
                                "(torch.set_num_threads); null: torch's default")
    reuse_memory: bool = Field(
        True, description="CPU runs on Linux with glibc: keep the memory a step frees in "
        "the process for the next step (glibc malloc: no mapping of its own for any block, "
        "no trimming of the heap), instead of handing it back and faulting it in again page "
        "by page each step; the process then keeps its peak memory until it exits. false: "
        "malloc's defaults")
    prefetch: int = Field(2, ge=0, description="batches prepared ahead in a background "
                          "thread, in training and evaluation (0: none; unused for a split "
                          "held on the device)")
    log_every_steps: int = Field(50, gt=0, description="steps between training-loss records "
                                 "(metrics.jsonl, progress bar, divergence check); the loss "
                                 "is read from the device only then")
    tensorboard: bool = Field(True, description="also write the metrics as TensorBoard "
                              "scalars to the run's tensorboard/ (needs the tensorboard "
                              "extra)")
    progress: bool = Field(True, description="show a progress bar (loss, samples/s) while "
                           "training")
