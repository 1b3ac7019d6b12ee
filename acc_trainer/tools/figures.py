"""The figures of the tools: `acc-trainer report`'s comparison of runs and `acc-trainer bench`'s
speed and time-breakdown charts (a run's own curves are drawn by acc_trainer/outputs/plots.py)."""

from __future__ import annotations

from pathlib import Path

from ..outputs.plots import STYLE, plt, read_metrics, save_figure, smooth

COLOURS = {"acc_trainer": "tab:blue", "raw": "tab:gray", "raw-ddp": "tab:orange", "dp": "tab:green"}

def plot_comparison(runs: list[Path], labels: list[str], path: Path) -> Path:
    """Training loss, evaluation metric and throughput of several runs, overlaid, in one PNG."""
    data = [read_metrics(run) for run in runs]
    has_accuracy = all(evals and "eval_accuracy" in evals[0] for _, evals in data)
    with plt.rc_context(STYLE):
        fig, (loss_ax, eval_ax, speed_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
        for (train, evals), label in zip(data, labels, strict=True):
            steps = [r["step"] for r in train]
            line, = loss_ax.plot(steps, smooth([r["loss"] for r in train]), lw=2, label=label)
            if evals and (has_accuracy or "eval_loss" in evals[0]):
                key = "eval_accuracy" if has_accuracy else "eval_loss"
                scale = 100 if has_accuracy else 1
                eval_ax.plot([r["step"] for r in evals], [scale * r[key] for r in evals], "o-", color=line.get_color(),
                             label=label)
            speed_ax.plot(steps, [r["samples_per_s"] for r in train], lw=1.5, color=line.get_color(), label=label)
        loss_ax.set(title="Training loss (smoothed)", xlabel="optimizer step", ylabel="loss")
        eval_ax.set(title="Evaluation " + ("accuracy" if has_accuracy else "loss"), xlabel="optimizer step",
                    ylabel="accuracy (%)" if has_accuracy else "loss")
        speed_ax.set(title="Throughput", xlabel="optimizer step", ylabel="samples / s")
        speed_ax.set_ylim(bottom=0)
        for ax in (loss_ax, eval_ax, speed_ax):
            ax.legend(fontsize=8)
        return save_figure(fig, path)


def plot_bench(rows: list[dict], folder: Path, title: str) -> list[Path]:
    """The scaling experiment's figures: performance (4 panels) and where the step time goes."""
    labels = [f"{r['implementation']}\n{r['processes']} proc." for r in rows]
    colours = [COLOURS.get(r["implementation"], "tab:purple") for r in rows]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        panels = [
            (axes[0][0], [r["time_s"] for r in rows], "Total training time", "seconds", ".2f"),
            (axes[0][1], [1000 * r["step_time_s"] for r in rows], "Average step time", "ms per step", ".1f"),
            (axes[1][0], [r["samples_per_s"] for r in rows], "Throughput", "samples / s", ",.0f"),
        ]
        for ax, values, name, unit, fmt in panels:
            bars = ax.bar(range(len(rows)), values, color=colours)
            ax.bar_label(bars, labels=[format(v, fmt) for v in values], fontsize=8, padding=2)
            ax.set(title=name, ylabel=unit)
            ax.set_xticks(range(len(rows)), labels, fontsize=8)
            ax.margins(y=0.15)
        ax = axes[1][1]
        most = max(r["processes"] for r in rows)
        ax.plot([1, most], [1, most], "--", color="black", lw=1, label="ideal (linear)")
        for kind in dict.fromkeys(r["implementation"] for r in rows):
            points = sorted((r["processes"], r["speedup"]) for r in rows if r["implementation"] == kind and r["speedup"])
            if kind == "raw-ddp":  # the DDP loop's 1-process point is the raw loop
                points = [(1, 1.0)] + points
            if points:
                ax.plot(*zip(*points), "o-", color=COLOURS.get(kind, "tab:purple"), lw=2, label=kind)
        ax.set(title="Speedup vs 1 process", xlabel="processes", ylabel="speedup (x)")
        ax.set_xticks(range(1, most + 1))
        ax.legend(fontsize=8)
        fig.suptitle(f"Performance: {title}", fontsize=11)
        performance = save_figure(fig, folder / "bench_performance.png")

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        data_ms = [1000 * r["data_time_s"] for r in rows]
        compute_ms = [1000 * r["compute_time_s"] for r in rows]
        x = range(len(rows))
        left.bar(x, data_ms, color="tab:red", alpha=0.8, label="waiting for data")
        left.bar(x, compute_ms, bottom=data_ms, color="tab:blue", alpha=0.8, label="compute (forward, backward, step)")
        left.set(title="Time per step", ylabel="ms per step")
        left.set_xticks(x, labels, fontsize=8)
        share = [100 * d / (d + c) if d + c else 0 for d, c in zip(data_ms, compute_ms, strict=True)]
        bars = right.bar(x, share, color="tab:red", alpha=0.8)
        right.bar_label(bars, labels=[f"{s:.0f} %" for s in share], fontsize=8, padding=2)
        right.set(title="Share of step time waiting for data", ylabel="% of step time", ylim=(0, 100))
        right.set_xticks(x, labels, fontsize=8)
        fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=2)
        fig.suptitle(f"Time breakdown: {title}", fontsize=11)
        breakdown = save_figure(fig, folder / "bench_time_breakdown.png", rect=(0, 0.07, 1, 1))
    return [performance, breakdown]
