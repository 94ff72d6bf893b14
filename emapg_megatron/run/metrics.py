"""Training metrics: a progress line per step with ETA, JSONL, TensorBoard, Weights & Biases
(optional), rollout dumps and a PNG of curves.

Only the logging rank (global rank 0) writes; others get a no-op logger.
"""

from __future__ import annotations

import json
import math
import os
import time

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch.utils.tensorboard import SummaryWriter

from emapg_megatron.run.config import CURVES_FILE, METRICS_FILE, ROLLOUTS_FILE

PROGRESS_KEYS = ("reward_mean", "kl", "clip_frac", "ema_lag", "entropy", "ema/stability_margin", "eval/pass@1")
PLOT_KEYS = ("reward_mean", "kl", "entropy", "clip_frac", "ema_lag", "pg_loss")


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def run_name(start_step: int) -> str:
    """This run's TensorBoard folder: its start time, and the step it resumed from."""
    return time.strftime("run-%Y%m%d-%H%M%S") + (f"-from-step-{start_step}" if start_step else "")


class MetricsLogger:
    def __init__(self, log_dir: str, total_steps: int, *, tensorboard_dir: str | None = None,
                 enabled: bool = True, start_step: int = 0, log_interval: int = 1,
                 wandb_project: str | None = None, wandb_name: str | None = None,
                 run_config: dict | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_interval = log_interval
        self.start_step = start_step
        self.t0 = time.monotonic()
        self.log_dir = log_dir
        self.failure: str | None = None  # why the last record could not be written
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, METRICS_FILE)
        trim_jsonl(path, start_step)
        self.jsonl = open(path, "a", encoding="utf-8")
        # Each run (a resume too) in its own folder: TensorBoard shows them as runs side by side.
        self.tb_dir = os.path.join(tensorboard_dir or os.path.join(log_dir, "tensorboard"), run_name(start_step))
        self.tb = SummaryWriter(self.tb_dir)
        self.wandb = None
        if wandb_project:
            import wandb  # the [wandb] extra; its presence is checked before any work

            self.wandb = wandb.init(project=wandb_project, name=wandb_name, dir=log_dir,
                                    config=run_config or {}, resume="allow")

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        try:
            self._append(json.dumps(record) + "\n")
        except OSError as e:  # a full or read-only --log-dir: the loop stops every rank with it
            self.failure = (f"--log-dir {self.log_dir}: cannot write the metrics of step {step} "
                            f"({e.strerror or e}); metrics.jsonl keeps the steps before it")
            return
        for k, v in record.items():
            if k != "step":
                self.tb.add_scalar(k, v, step)
        self.tb.flush()  # a run that stops with an error or a signal keeps its last steps
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if step % self.log_interval == 0 or step == self.total_steps:
            print(self.progress_line(step, record), flush=True)

    def _append(self, line: str) -> None:
        """One whole line or none: a failed write is cut back to the file's previous end."""
        end = self.jsonl.tell()
        try:
            self.jsonl.write(line)
            self.jsonl.flush()
        except OSError:
            self.jsonl.seek(end)
            self.jsonl.truncate()
            raise

    def progress_line(self, step: int, record: dict) -> str:
        done = step - self.start_step
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.total_steps - step) if done > 0 else float("nan")
        parts = [f"step {step:>5d}/{self.total_steps}"]
        parts += [f"{k} {record[k]:.4f}" for k in PROGRESS_KEYS if k in record]
        if "tokens_per_s" in record:
            parts.append(f"tok/s {record['tokens_per_s']:.0f}")
        if "weight_sync_s" in record:
            parts.append(f"sync {record['weight_sync_s']:.2f}s")
        if record.get("skipped"):
            parts.append("SKIPPED (non-finite)")
        parts.append(f"elapsed {format_eta(elapsed)} eta {format_eta(eta)}")
        return " | ".join(parts)

    def dump_rollouts(self, step: int, samples) -> None:
        """Append ``(prompt, response, reward)`` of every sequence of ``step`` to rollouts.jsonl."""
        if not self.enabled:
            return
        with open(os.path.join(self.log_dir, ROLLOUTS_FILE), "a", encoding="utf-8") as f:
            for prompt, response, reward in samples:
                f.write(json.dumps({"step": step, "prompt": prompt, "response": response,
                                    "reward": reward}, ensure_ascii=False) + "\n")

    def warn(self, message: str) -> None:
        if self.enabled:
            print(f"warning: {message}", flush=True)

    def close(self) -> str | None:
        """Flush and write ``curves.png``; returns its path."""
        if not self.enabled:
            return None
        self.jsonl.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        return plot_curves(os.path.join(self.log_dir, METRICS_FILE), os.path.join(self.log_dir, CURVES_FILE))


def trim_jsonl(path: str, last_step: int) -> None:
    """Keep the records of steps <= ``last_step`` (a resumed run logs the later ones again).

    Unreadable lines (a run killed mid-write) are dropped; the file is replaced atomically.
    """
    if not os.path.isfile(path):
        return
    kept, changed = [], False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
                keep = int(record["step"]) <= last_step
            except (ValueError, TypeError, KeyError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            changed |= not keep or not line.endswith("\n")
    if not changed:
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


#: What each plotted metric is, for its y axis.
AXIS_LABELS = {"reward_mean": "mean reward", "kl": "KL to the anchor (per token)", "entropy": "entropy (nats)",
               "ema_lag": "|θ - θ_ema| / |θ|", "clip_frac": "clipped share of tokens",
               "response_len": "tokens", "pg_loss": "policy-gradient loss"}


def plot_curves(jsonl_path: str, png_path: str, keys=PLOT_KEYS, title: str | None = None) -> str | None:
    """``png_path``, or None when nothing was logged yet (a run stopped before its first step).
    ``title``: the run's (default: the log folder's name)."""
    records = read_jsonl(jsonl_path)
    run = title or os.path.basename(os.path.dirname(os.path.abspath(jsonl_path)))
    fig = curves_figure(records, keys, run)
    if fig is None:
        return None
    fig.savefig(png_path, dpi=110)
    return png_path


def curves_figure(records: list[dict], keys, run: str) -> Figure | None:
    """One panel per logged metric of ``keys`` against the step, titled with the run's name."""
    keys = [k for k in keys if any(k in r for r in records)]
    if not keys:
        return None
    fig = Figure(figsize=(3.2 * len(keys), 3.0))  # no pyplot: no global figure state, no GUI backend
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        pts = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(AXIS_LABELS.get(key, key))
        ax.grid(alpha=0.3)
    fig.suptitle(f"{run}: {len(records)} steps", fontsize=10)
    fig.tight_layout()
    return fig
