"""`acc-trainer report RUN_DIR [RUN_DIR ...]`: compare finished (or stopped) runs.

Prints a rich table of their final metrics, time, speed, world size and precision, and writes a
figure with their curves overlaid.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..config import ConfigError
from ..flags import Parser
from ..outputs.plots import read_metrics
from ..outputs.progress import format_metric, make_console
from ..workload.metrics import best_evaluation, ranked_by
from .figures import plot_comparison


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="acc-trainer report", description="Compare runs: a table in the terminal and a figure.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (each holds metrics.jsonl)")
    parser.add_argument("--labels", nargs="+", metavar="LABEL", help="names for the runs in the table and figure")
    parser.add_argument("--output", default="report.png", metavar="FILE", help="comparison figure (default: report.png)")
    return parser


def load_run(path: Path) -> dict:
    """What the table shows of one run; a folder that is not a run is the user's mistake."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder")
    if not (path / "metrics.jsonl").is_file():
        raise ConfigError(f"{path} is not a run folder (it has no metrics.jsonl)")
    summary_file = path / "summary.json"
    if summary_file.is_file():
        try:
            return json.loads(summary_file.read_text())
        except ValueError:
            raise ConfigError(f"{summary_file} is not valid JSON") from None
    train, evals = read_metrics(path)  # a run stopped before its end: what it logged
    last = evals[-1] if evals else {}
    return {"stopped": True, "steps": train[-1]["step"] if train else 0,
            "eval": {k[5:]: v for k, v in last.items() if k.startswith("eval_") and k != "eval_samples"}}


def report(runs: list[Path], labels: list[str], output: Path, console: Console | None = None) -> Table:
    console = console or make_console()
    summaries = [load_run(run) for run in runs]
    table = Table(title="acc_trainer runs")
    for column in ("run", "model / data", "processes", "precision", "steps", "accuracy", "eval loss",
                   "other metrics", "best", "wall time", "samples/s"):
        table.add_column(column, justify="left" if column in ("run", "model / data") else "right")
    for label, s in zip(labels, summaries, strict=True):
        final = s.get("eval") or {}
        best = _best(s)
        table.add_row(
            label,
            f"{s['model']} / {s['dataset']}" if "model" in s else "(stopped)",
            str(s.get("world_size", "?")),
            str(s.get("mixed_precision", "?")),
            str(s.get("steps", "?")),
            f"{final['accuracy']:.2%}" if "accuracy" in final else "-",
            f"{final['loss']:.4f}" if "loss" in final else "-",
            ", ".join(format_metric(k, v) for k, v in final.items() if k not in ("accuracy", "loss")) or "-",
            best,
            f"{s['wall_time_s']:.1f} s" if "wall_time_s" in s else "-",
            f"{s['samples_per_s']:,.0f}" if s.get("samples_per_s") else "-",
        )
    console.print(table)
    differing = _differing_options(runs, labels)
    if differing:
        console.print(f"options that differ: {differing}", markup=False, soft_wrap=True)
    plot_comparison(runs, labels, output)
    console.print(f"comparison figure: {output}")
    return table


def _differing_options(runs: list[Path], labels: list[str]) -> str:
    """The options (config.yaml) whose values differ between the runs, each with every run's value: `--lr (a: 0.1, b:
    0.01)`; the folders they wrote to and how they showed progress left out."""
    from ..config import load_yaml
    from ..outputs.checkpoints import MAY_CHANGE

    configs = [load_yaml(run / "config.yaml") if (run / "config.yaml").is_file() else {} for run in runs]
    names = sorted({name for config in configs for name in config} - MAY_CHANGE)
    differ = [name for name in names if len({repr(config.get(name)) for config in configs}) > 1]
    return "; ".join(f"--{name.replace('_', '-')} (" + ", ".join(f"{label}: {config.get(name)}"
                                                              for label, config in zip(labels, configs, strict=True)) + ")"
                     for name in differ)


def _best(summary: dict) -> str:
    """The run's best evaluation by its own measure (summary.json's `best`, as --save-best keeps it)."""
    best = summary.get("best")
    evals = summary.get("evals") or []
    if not best and evals:  # a summary written before `best` was always filled in
        metric = ranked_by(evals)
        found = best_evaluation(evals, metric) if metric else None
        best = {"step": found["step"], "metric": metric, "value": found[metric]} if found else None
    if not best:
        return "-"
    return f"{format_metric(best['metric'], best['value'])} @ {best['step']}"


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    runs = [Path(r) for r in args.runs]
    labels = args.labels or [r.name for r in runs]
    if len(labels) != len(runs):
        raise ConfigError(f"--labels names {len(labels)} runs, but {len(runs)} were given")
    report(runs, labels, Path(args.output))
