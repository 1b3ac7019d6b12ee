"""Figures of runs, drawn with matplotlib (Agg, PNG) from the files a run writes.

`plot_run` draws one run's curves into <run>/plots/ (tools/figures.py overlays several runs). Both
read metrics.jsonl, so they work the same for a finished run, a stopped one and an old one.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: no display needed, safe on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

from .progress import PERCENT_METRICS  # noqa: E402

STYLE = {"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
         "axes.spines.right": False, "font.size": 10, "axes.titlesize": 11, "legend.frameon": False}


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """The training records and the evaluation records of a run's metrics.jsonl."""
    train, evals = [], []
    for line in (Path(run) / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a last line cut short by a kill
            continue
        if "loss" in record:
            train.append(record)
        elif "eval_samples" in record:
            evals.append(record)
    return train, evals


def smooth(values: list[float]) -> list[float]:
    """Exponential moving average with bias correction, as TensorBoard smooths curves, over about a
    fifteenth of the curve: a short run is barely smoothed, a long one evenly."""
    span = max(1.0, len(values) / 15)
    weight = 1 - 2 / (span + 1)
    out, average = [], 0.0
    for i, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i))
    return out


def save_figure(fig, path: Path, rect=(0, 0, 1, 1)) -> Path:
    fig.tight_layout(rect=rect)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_run(run: Path) -> list[Path]:
    """Writes <run>/plots/{loss,eval,lr,throughput,time_split}.png; returns the files written."""
    run = Path(run)
    train, evals = read_metrics(run)
    folder = run / "plots"
    folder.mkdir(exist_ok=True)
    title = run_title(run)
    written = []
    with plt.rc_context(STYLE):
        if train:
            written.append(plot_loss(train, evals, title, folder))
            written.append(plot_lr(train, title, folder))
            written.append(plot_throughput(train, title, folder))
            written.append(plot_time_split(train, title, folder))
        names = evaluated_quantities(evals)
        if names:
            written.append(plot_evaluations(evals, names, title, folder))
        written += plot_confusion(run, folder)
    return written


def plot_loss(train: list[dict], evals: list[dict], title: str, folder: Path) -> Path:
    """loss.png: the training loss, raw and smoothed, and the evaluation loss where there is one."""
    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(figsize=(7, 4))
    losses = [r["loss"] for r in train]
    ax.plot(steps, losses, color="tab:blue", alpha=0.35, lw=1, label="training loss (each log step)")
    ax.plot(steps, smooth(losses), color="tab:blue", lw=2, label="training loss (smoothed)")
    if evals and "eval_loss" in evals[0]:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", color="tab:orange",
                lw=1.5, label="evaluation loss")
    ax.set(title=f"Loss: {title}", xlabel="optimizer step", ylabel="loss (mean over all processes)")
    ax.legend()
    return save_figure(fig, folder / "loss.png")


def plot_lr(train: list[dict], title: str, folder: Path) -> Path:
    """lr.png: the learning rate at each log step."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:purple", lw=2)
    ax.set(title=f"Learning rate: {title}", xlabel="optimizer step", ylabel="learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return save_figure(fig, folder / "lr.png")


def plot_throughput(train: list[dict], title: str, folder: Path) -> Path:
    """throughput.png: samples per second over all processes."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in train], [r["samples_per_s"] for r in train], color="tab:green", lw=1.5)
    ax.set(title=f"Throughput: {title}", xlabel="optimizer step", ylabel="samples / s (all processes)")
    ax.set_ylim(bottom=0)
    return save_figure(fig, folder / "throughput.png")


def plot_time_split(train: list[dict], title: str, folder: Path) -> Path:
    """time_split.png: each step's time waiting for data and computing, and the share spent waiting."""
    steps = [r["step"] for r in train]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    data_ms = [1000 * r["data_time_s"] for r in train]
    compute_ms = [1000 * (r["step_time_s"] - r["data_time_s"]) for r in train]
    left.stackplot(steps, data_ms, compute_ms, labels=["waiting for data", "compute"],
                   colors=["tab:red", "tab:blue"], alpha=0.7)
    left.set(title="Time per step", xlabel="optimizer step", ylabel="ms per step")
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=2)
    share = [100 * d / (d + c) if d + c > 0 else 0 for d, c in zip(data_ms, compute_ms, strict=True)]
    right.plot(steps, share, color="tab:red", lw=1.5)
    right.set(title="Share of time waiting for data", xlabel="optimizer step", ylabel="% of step time",
              ylim=(0, 100))
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, folder / "time_split.png", rect=(0, 0.07, 1, 1))


def evaluated_quantities(evals: list[dict]) -> list[str]:
    """The evaluation records' keys to plot: the loss first, then each metric by name."""
    names = [k for k in (evals[0] if evals else {}) if k.startswith("eval_") and k != "eval_samples"]
    return ["eval_loss"] * ("eval_loss" in names) + [k for k in names if k != "eval_loss"]


def plot_evaluations(evals: list[dict], names: list[str], title: str, folder: Path) -> Path:
    """eval.png: one panel per evaluated quantity (`names`), a metric in percent where it is one."""
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names) + 1, 3.8), squeeze=False)
    eval_steps = [r["step"] for r in evals]
    colors = ["tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    for ax, key, color in zip(axes[0], names, colors * len(names)):
        name = key[5:]
        percent = name in PERCENT_METRICS
        ax.plot(eval_steps, [(100 if percent else 1) * r[key] for r in evals], "o-", color=color)
        ax.set(title=f"Evaluation {name}", xlabel="optimizer step",
               ylabel=f"{name} (%)" if percent else name)
    fig.suptitle(f"Evaluation ({evals[-1]['eval_samples']} samples each): {title}", fontsize=10)
    return save_figure(fig, folder / "eval.png")


def plot_confusion(run: Path, folder: Path) -> list[Path]:
    """<run>/plots/confusion.png: the final evaluation's confusion matrix of a classification run (rows: the
    true class, columns: the predicted one; each row's share), from summary.json."""
    summary = Path(run) / "summary.json"
    matrix = json.loads(summary.read_text()).get("confusion_matrix") if summary.exists() else None
    if not matrix:
        return []
    classes = json.loads(summary.read_text())["classes"]
    counts = np.array(matrix, dtype=float)
    shares = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    side = min(12.0, 2.5 + 0.45 * len(classes))
    fig, ax = plt.subplots(figsize=(side + 1, side))
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    ax.grid(False)
    if len(classes) <= 30:
        ax.set_xticks(range(len(classes)), classes, rotation=90 if len(classes) > 10 else 0)
        ax.set_yticks(range(len(classes)), classes)
    if len(classes) <= 15:
        for i in range(len(classes)):
            for j in range(len(classes)):
                if counts[i, j]:
                    ax.text(j, i, int(counts[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if shares[i, j] > 0.5 else "black")
    ax.set(title=f"Confusion matrix ({int(counts.sum())} evaluation samples)", xlabel="predicted class",
           ylabel="true class")
    fig.colorbar(image, ax=ax, fraction=0.046, label="share of the true class")
    return [save_figure(fig, folder / "confusion.png")]


def run_title(run: Path) -> str:
    summary = run / "summary.json"
    config = run / "config.yaml"
    if summary.exists():
        s = json.loads(summary.read_text())
        processes = "1 process" if s["world_size"] == 1 else f"{s['world_size']} processes"
        precision = "fp32" if s["mixed_precision"] == "no" else s["mixed_precision"]
        return f"{s['model']} on {s['dataset']}, {processes}, {precision}"
    if config.exists():
        import yaml

        c = yaml.safe_load(config.read_text())
        return f"{c['model']} on {c['dataset']} (stopped early)"
    return run.name
