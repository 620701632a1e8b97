"""Where training reports go: ``metrics.jsonl`` (always), TensorBoard (when installed), and
a rich progress bar on the console."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


class MetricsLog:
    """Appends one JSON object per record to ``metrics.jsonl``; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, console: Console | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if console is not None:
                    console.print("[dim]tensorboard is not installed; scalars go to "
                                  "metrics.jsonl only (pip install 'sampan\\[tensorboard]')[/]")
            else:
                self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run rewrites what came after its checkpoint)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short when the run was killed
                continue
            if rec.get("step", 0) <= step:
                keep.append(line)
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            split = record.get("split", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch", "time"):
                    self.writer.add_scalar(f"{split}/{k}", v, record.get("step", 0))
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def make_progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[speed]} samples/s"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled,
    )


SAMPLED_ROWS = 4096  # embedding rows whose norm stands for a table's in the log


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """The L2 norm of the dense gradients, on the device (no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def embedding_norms(model: torch.nn.Module) -> dict[str, float]:
    """The mean L2 norm of embedding rows per table collection, over at most
    :data:`SAMPLED_ROWS` rows spread evenly over each table (cheap for any size)."""
    from sampan.embedding import EmbeddingCollection

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, EmbeddingCollection) and not m.weight.is_meta and len(m.weight):
            w = m.weight.detach()
            rows = torch.linspace(0, len(w) - 1, min(len(w), SAMPLED_ROWS),
                                  device=w.device).long()
            key = "embedding_norm" + (f"/{name}" if name else "")
            out[key] = float(w.index_select(0, rows).float().norm(dim=1).mean())
    return out


def train_record(trainer: Any, loss: float, speed: float) -> dict[str, Any]:
    """The train record of a log step: loss, speed, learning rate, the dense gradient norm
    of this step (vanishing or exploding gradients) and the embedding row norms."""
    from sampan.train.schedules import lr_factor

    st, tc = trainer.state, trainer.tc
    rec = {"step": st.step, "epoch": st.epoch, "split": "train", "loss": loss,
           "samples_per_s": speed,
           "lr": trainer.base_lrs[-1][0] * st.lr_scale * lr_factor(
               st.step - 1, trainer.total_steps, tc.warmup_steps, tc.schedule,
               tc.min_lr_ratio)}
    if trainer.last_grad_norm is not None:
        rec["grad_norm"] = float(trainer.last_grad_norm)
    return {**rec, **embedding_norms(trainer.model)}
