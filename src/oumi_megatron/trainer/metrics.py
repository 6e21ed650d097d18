"""Step metrics: JSONL (output_dir/metrics.jsonl), TensorBoard (output_dir/tensorboard), W&B (optional) and PNG plots."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("oumi")


class MetricsLogger:
    """Rank 0 writes; other ranks hold a no-op logger.

    ``start_step``: the step training continues from. Rows of later steps already in metrics.jsonl
    (an interrupted run's, after its last checkpoint) are dropped and TensorBoard purges its events
    from there on, so a resumed run logs every step once. ``wandb_run`` (``training.enable_wandb``):
    keyword arguments for ``wandb.init``; the same scalars go to W&B.
    """

    def __init__(self, output_dir: str | Path, enabled: bool = True, tensorboard: bool = True, start_step: int = 0,
                 wandb_run: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dropped = self._drop_rows_after(start_step)
        if dropped:
            logger.warning(f"{self.path}: dropped {dropped} row(s) of steps after {start_step} (logged by an interrupted "
                           "run after its last checkpoint); those steps are trained and logged again.")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = Path(output_dir) / "tensorboard"
            resumed = tb_dir.is_dir() and any(tb_dir.iterdir())
            # purge_step: TensorBoard discards this run's earlier events at steps >= purge_step
            self.writer = SummaryWriter(str(tb_dir), purge_step=start_step + 1 if resumed else None)
        if wandb_run is not None:
            import wandb

            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "oumi-megatron"), dir=str(output_dir),
                                    **wandb_run)

    def _drop_rows_after(self, step: int) -> int:
        rows = read_metrics(self.path)
        keep = [r for r in rows if r.get("step", 0) <= step]
        if len(keep) == len(rows):
            return 0
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)  # atomic: the old file or the new one, never half of it
        return len(rows) - len(keep)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


PLOTTED = ("reward/mean", "loss", "kl", "eval/reward_mean", "eval/accuracy", "eval/format_rate", "eval/completion_length/mean")
"""``eval/x`` stands for every eval set's ``x`` (``eval/accuracy``, ``eval_unseen/accuracy``, ...): one figure, a line each."""


def _eval_prefixes(rows: list[dict[str, Any]]) -> list[str]:
    """The eval sets' metric prefixes in the rows (``eval`` first), from their ``<prefix>/samples``."""
    found = {k.rsplit("/", 1)[0] for r in rows for k in r if k.endswith("/samples") and k.count("/") == 1}
    return sorted(found, key=lambda p: (p != "eval", p))


def plot_curves(output_dir: str | Path, keys: tuple[str, ...] = PLOTTED) -> list[Path]:
    """One PNG per metric (reward, loss, KL; held-out reward, accuracy, format rate and length of every eval set
    when the run evaluates) from metrics.jsonl into output_dir/plots/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(output_dir) / "metrics.jsonl")
    out_dir = Path(output_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    prefixes = _eval_prefixes(rows)
    written = []
    for key in keys:
        lines = [f"{p}/{key[len('eval/'):]}" for p in prefixes] if key.startswith("eval/") else [key]
        curves = {line: [(r["step"], r[line]) for r in rows if isinstance(r.get(line), (int, float))] for line in lines}
        curves = {line: points for line, points in curves.items() if points}
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for line, points in curves.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=line)
        if len(curves) > 1:
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(key.removeprefix("eval/") if len(curves) > 1 else key)
        ax.set_title(" vs ".join(curves) if len(curves) > 1 else key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
