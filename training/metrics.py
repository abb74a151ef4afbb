"""What a run reports: metrics JSONL, the loss-curve PNG and the progress bar (rank 0 only).

metrics.jsonl has one object per line: training lines {"step", "loss", "lr", "grad_norm",
"tokens", "tokens_per_s", "elapsed_s"} and evaluation lines {"step", "val_loss", "elapsed_s"}.
A resumed run first drops the lines past the checkpoint's step, so the file reads as one run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.is_file():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in keep))
        self._f = open(self.path, "a")  # noqa: SIM115 - held open for the run, closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Training and validation loss against step (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.8, label="train")
    if val:
        ax.plot(*zip(*val), "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png_path)
    fig.savefig(png)
    plt.close(fig)
    return png


class Progress:
    """A tqdm bar over steps with loss, validation loss and tokens/s; silent when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str = "train"):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                            smoothing=0.1)
        self.fields: dict[str, str] = {}

    def update(self, n: int = 1, total: int | None = None, **fields: float) -> None:
        if self.bar is None:
            return
        for k, v in fields.items():
            if v is not None and math.isfinite(v):
                self.fields[k] = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"
        if total is not None and total != self.bar.total:
            self.bar.total = total  # a time budget moves the expected last step
        self.bar.set_postfix(self.fields, refresh=False)
        self.bar.update(n)

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
