"""The results of `acc-trainer sweep` (sweep.py): the trials as a table (printed, and <sweep>/trials.csv) and a figure
(<sweep>/trials.png), the best trial and the command that runs it again.
"""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

from .sweep_space import Space


def rerun_command(space: Space, number: int) -> str:
    """The command that runs trial `number` again, as its own run."""
    config = space.folder / f"trial-{number}" / "trial.yaml"
    return f"{space.launcher} --config {shlex.quote(str(config))} --output-dir runs/{space.study}-trial-{number}"


def _shown(params: dict) -> str:
    return ", ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                     for name, value in params.items())


def show_results(study, space: Space, console) -> None:
    """The trials as a table (printed, and <sweep>/trials.csv) and a figure (<sweep>/trials.png), the best trial and
    the command that runs it again."""
    from optuna.trial import TrialState
    from rich.table import Table

    trials = study.get_trials(deepcopy=False)
    if not trials:
        return
    names = list(dict.fromkeys([*space.search, *(name for t in trials for name in t.params)]))
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = study.best_trial.number if complete else None
    rows = [_row(t, names) for t in trials]
    header = ["trial", "state", space.metric, "step", *names, "seconds"]
    table = Table(title=f"study {space.study}: {len(trials)} trials, " + ", ".join(
        f"{sum(t.state == state for t in trials)} {state.name.lower()}" for state in TrialState
        if any(t.state == state for t in trials)))
    for column in header:
        table.add_column(column, justify="left" if column == "state" else "right")
    for trial, row in zip(trials, rows, strict=True):
        table.add_row(*[_cell(v) for v in row], style="bold" if trial.number == best else None)
    with open(space.folder / "trials.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    plot_trials(trials, best, space, space.folder / "trials.png")
    console.print(table)
    if best is not None:
        console.print(f"best: trial {best}, {space.metric} {study.best_value:.6g} ({_shown(study.best_params)})",
                      markup=False)
        console.print(f"run it again: {rerun_command(space, best)}", markup=False)
    console.print(f"table and figure: {space.folder / 'trials.csv'}, {space.folder / 'trials.png'}", markup=False)


def _row(trial, names: list[str]) -> list:
    steps = sorted(trial.intermediate_values)
    value = trial.value if trial.value is not None else trial.intermediate_values[steps[-1]] if steps else None
    return [trial.number, trial.state.name.lower(), value, steps[-1] if steps else None,
            *[trial.params.get(name) for name in names], trial.user_attrs.get("seconds")]


def _cell(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def plot_trials(trials: list, best: int | None, space: Space, path: Path) -> Path:
    """Left: each trial's metric at each evaluation (pruned ones grey and dashed, ending in x; the best in red).
    Right: each trial's result by trial number, with the best so far."""
    from matplotlib.ticker import MaxNLocator
    from optuna.trial import TrialState

    from ..outputs.plots import STYLE, plt, save_figure

    with plt.rc_context(STYLE):
        fig, (curves, results) = plt.subplots(1, 2, figsize=(12, 4.2))
        better, best_so_far, numbers = (max if space.direction == "maximize" else min), [], []
        for trial in trials:
            steps = sorted(trial.intermediate_values)
            values = [trial.intermediate_values[s] for s in steps]
            if not steps:
                continue
            if trial.state == TrialState.PRUNED:
                curves.plot(steps, values, "--", color="0.6", lw=1)
                curves.plot(steps[-1:], values[-1:], "x", color="0.4")
                results.plot([trial.number], values[-1:], "x", color="0.4")
            elif trial.state == TrialState.COMPLETE:
                top = trial.number == best
                curves.plot(steps, values, "-", color="tab:red" if top else "tab:blue", lw=2.5 if top else 1,
                            alpha=1 if top else 0.6, zorder=3 if top else 2, label=f"best: trial {best}" if top else None)
                results.plot([trial.number], [trial.value], "o", color="tab:red" if top else "tab:blue")
                best_so_far.append(better([*best_so_far[-1:], trial.value]))
                numbers.append(trial.number)
            else:
                curves.plot(steps, values, ":", color="tab:orange", lw=1)
        if numbers:
            results.step(numbers, best_so_far, where="post", color="tab:red", lw=1, label="best so far")
            results.legend(fontsize=8)
            curves.legend(fontsize=8)
        results.xaxis.set_major_locator(MaxNLocator(integer=True))
        curves.set(title=f"{space.metric} at each evaluation (grey: pruned)", xlabel="optimizer step", ylabel=space.metric)
        results.set(title=f"{space.metric} of each trial (x: pruned)", xlabel="trial", ylabel=space.metric)
        return save_figure(fig, path)
