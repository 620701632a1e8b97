"""Where training reports go: ``metrics.jsonl`` (always), TensorBoard (when installed), and
a rich progress bar on the console."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

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
