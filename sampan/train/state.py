"""Where training is: the counters every checkpoint saves, and the checkpoint names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LAST = "last.pt"
BEST = "best.pt"
START = "start.pt"  # the state before the first step: what a divergence before last.pt
#                     goes back to; removed when the first last.pt is written


@dataclass

class TrainState:
    """Counters that say where training is; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # next batch index within `epoch`
    best: float | None = None
    best_step: int = 0
    bad_evals: int = 0  # evaluations since the trained model last improved on itself
    # the best evaluation of the trained model itself: with a first-order warm start, the
    # step-0 evaluation (the LR) is the floor for ``best`` but not where patience counts from
    trained_best: float | None = None
    stopped_early: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)
    lr_scale: float = 1.0  # halved by each recovery from a divergence
    recoveries: int = 0
    seconds: float = 0.0  # training time so far, across resumes
    window: tuple[float, int] = (0.0, 0)  # loss sum and steps since the last log record
