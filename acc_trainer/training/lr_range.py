"""The learning-rate range test (Smith, "Cyclical Learning Rates for Training Neural Networks", 2015, as fastai's
`lr_find` and Lightning's `Tuner.lr_find` run it): a short run whose learning rate grows exponentially from `min_lr`
to `max_lr`, one optimizer step at a time, with the loss of every step recorded.

The run is a real one, through the training loop (api.find_lr and api.range_test start it), so that whatever the
trainer takes, the test takes: accumulation, several processes, mixed precision, packing, LoRA, fit()'s objects.
This module holds what is particular to the test: its schedule (a scheduler factory, as fit() takes one), the
options its run overrides, and what is made of the run's metrics.jsonl afterwards: the curve, smoothed, cut where it
diverges, the learning rate where the smoothed loss falls fastest, `lr_find.json` and the figure `lr_find.png`.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..stopping import TrainingStopped

BETA = 0.98  # fastai's and Lightning's smoothing: an exponential moving average of the losses, bias-corrected
DIVERGED = 4.0  # the smoothed loss above 4x its lowest so far: the run diverged (fastai, Lightning)
FEWEST_STEPS = 10
# The trainer's own words when a step's loss is NaN or inf (loop._nonfinite_message): the run stops at that step,
# which ends the curve; any other stop (a signal, an unreadable sample) is the caller's to see.
NOT_FINITE = "the loss became NaN or inf"


@dataclass
class RangeTest:
    """A range test: its plan (`min_lr`, `max_lr`, `steps`) and, once run, its curve: each step's learning rate
    and loss up to `stopped_at` (the step where the smoothed loss passed 4x its lowest, or where the loss became
    NaN/inf, `stop_reason` says which; None: every step), the smoothed loss, the suggested learning rate, and the
    folder with lr_find.json and the figure."""

    min_lr: float = 1e-7
    max_lr: float = 1.0
    steps: int = 100
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    suggestion: float | None = None
    stopped_at: int | None = None
    stop_reason: str | None = None
    folder: Path | None = None
    figure: Path | None = None

    def __post_init__(self):
        for name in ("min_lr", "max_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value!r}")
        if not self.min_lr < self.max_lr:
            raise ConfigError(f"--min-lr {self.min_lr:g} must be below --max-lr {self.max_lr:g}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < FEWEST_STEPS:
            raise ConfigError(f"--steps takes a whole number of optimizer steps, at least {FEWEST_STEPS} (a curve to "
                              f"smooth and differentiate), got {self.steps!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0 is the first): min_lr x (max_lr / min_lr) ** (step / (steps - 1))."""
        return self.min_lr * (self.max_lr / self.min_lr) ** (step / (self.steps - 1))

    def as_json(self) -> dict:
        return {"suggestion": self.suggestion, "min_lr": self.min_lr, "max_lr": self.max_lr, "steps": self.steps,
                "stopped_at": self.stopped_at, "stop_reason": self.stop_reason, "lrs": self.lrs, "losses": self.losses,
                "smoothed": self.smoothed}


class Schedule:
    """The test's schedule, a scheduler factory(optimizer, total_steps) as fit() takes one: each optimizer step
    multiplies the learning rate by the same factor, from the run's `lr` (= min_lr) at the first step to max_lr at
    the last. Keeps the first parameter group's starting rate, by which the rates the run logs are read back in
    units of its `lr` (--scale-lr, --param-groups and --layer-decay scale a group's rate)."""

    def __init__(self, test: RangeTest):
        self.test, self.first_lr = test, None

    def __call__(self, optimizer, total_steps):
        self.first_lr = optimizer.param_groups[0]["lr"]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.test.lr_at(step) / self.test.min_lr)


def run_options(test: RangeTest, folder: Path) -> dict:
    """The options the test's run takes over the user's: `lr` is min_lr, exactly `steps` steps each logged, no
    evaluation, checkpoint, EMA, tracker or plot, and a NaN/inf loss stops it (with --skip-nonfinite such a step
    would log the loss of its finite micro-batches, 0 when there are none: a false minimum)."""
    return {"lr": test.min_lr, "max_steps": test.steps, "log_every": 1, "warmup_steps": 0, "eval_every": None,
            "early_stop": None, "save_best": None, "checkpoint_every": None, "keep_last": None, "resume": None,
            "skip_nonfinite": False, "ema": None, "prompts": None, "log_with": None, "plots": False,
            "lora_merge": False, "output_dir": str(folder / "run")}


def folder_for(output_dir: str | None, model_name: str, dataset_name: str) -> Path:
    """The test's folder: `output_dir`, or a new runs/lr-find-<time>-<model>-<dataset> named by the main process
    for every process (the process group is started)."""
    from ..outputs.runfiles import new_run_folder

    return Path(output_dir) if output_dir else new_run_folder(model_name, dataset_name, "lr-find-")


@contextmanager
def ending_where_not_finite(test: RangeTest):
    """The test's run, which a NaN/inf loss ends at its step (the steps before it are in metrics.jsonl): the test's
    `stop_reason` is "not finite" then. Every process stops alike (the losses are gathered before the check)."""
    try:
        yield
    except TrainingStopped as e:
        if not str(e).startswith(NOT_FINITE):
            raise
        test.stop_reason = "not finite"


def conclude(test: RangeTest, folder: Path, schedule: Schedule, title: str) -> RangeTest:
    """The test made from its run's metrics.jsonl (main process): the curve, its cut, the suggestion, lr_find.json
    and lr_find.png written. A curve too short to suggest from is written too, then raised as the ConfigError that
    says why."""
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "lr" in r]
    # A step logs the rate after its scheduler step: the next step's. The first step's is the run's `lr`.
    logged = [r["lr"] * test.min_lr / schedule.first_lr for r in steps]
    lrs, losses = [test.min_lr, *logged[:-1]], [r["loss"] for r in steps]
    smoothed = smooth(losses)
    end, reason = cut(smoothed)
    if reason is None and test.stop_reason == "not finite":  # the run stopped at the step after the last logged
        end, reason = len(losses), "not finite"
    test.lrs, test.losses, test.smoothed = lrs[:end], losses[:end], smoothed[:end]
    test.stopped_at, test.stop_reason = (end + (reason == "not finite")) if reason else None, reason
    test.folder, error = folder, None
    try:
        test.suggestion = test.lrs[steepest(test.lrs, test.smoothed)]
    except ConfigError as e:
        ended = f"the loss {reason} at step {test.stopped_at} of {test.steps}" if reason else "the run ended"
        error = ConfigError(f"{e} ({ended}; the curve is in {folder / 'lr_find.json'})")
    (folder / "lr_find.json").write_text(json.dumps(test.as_json(), indent=1) + "\n")
    test.figure = draw(test, folder / "lr_find.png", title)
    if error:
        raise error
    return test


def recorded_suggestion(folder: Path) -> float | None:
    """The suggestion the test in `folder` recorded in its lr_find.json (main process), None without the file; a test
    that suggested none, or a file that cannot be read, raises the ConfigError that says so."""
    path = Path(folder) / "lr_find.json"
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())["suggestion"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f'lr="find": {path} cannot be read ({type(e).__name__}: {e})')
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f'lr="find": the range test in {folder} suggested no learning rate (its curve is in '
                           "lr_find.json): give lr=, or test again into a new output_dir")
    return float(value)


def smooth(losses: list[float], beta: float = BETA) -> list[float]:
    """fastai's smoothing: an exponential moving average (weight `beta` on the past), divided by 1 - beta**i so that
    the first values are not pulled towards 0."""
    out, average = [], 0.0
    for i, loss in enumerate(losses, 1):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta**i))
    return out


def cut(smoothed: list[float]) -> tuple[int, str | None]:
    """How many points the curve keeps, and why it stops: at the first smoothed loss above 4x the lowest before it
    ("diverged", that point kept, as fastai and Lightning keep it), or at a NaN/inf ("not finite", left out)."""
    lowest = math.inf
    for i, value in enumerate(smoothed):
        if not math.isfinite(value):
            return i, "not finite"
        lowest = min(lowest, value)
        if value > DIVERGED * lowest:
            return i + 1, "diverged"
    return len(smoothed), None


def steepest(lrs: list[float], smoothed: list[float]) -> int:
    """The index of the steepest descent of the smoothed loss against log(lr), as Lightning's `suggestion()`: the
    most negative gradient, leaving out the first points (a tenth of the curve, at most 10: the average is still
    settling) and the last (where the curve was cut). Steps that did not move the rate on (fp16's skipped steps)
    are left out of the gradient."""
    begin, end = max(1, min(10, len(lrs) // 10)), len(lrs) - 1
    x, y = np.log10(np.asarray(lrs[begin:end], dtype=float)), np.asarray(smoothed[begin:end], dtype=float)
    kept = np.flatnonzero(np.r_[True, np.diff(x) > 0]) if len(x) else np.array([], dtype=int)
    if len(kept) < 3:
        raise ConfigError(f"the range test's curve has {len(lrs)} points, too few to suggest a learning rate from: "
                          "lower --min-lr, or give more --steps")
    gradient = np.gradient(y[kept], x[kept])
    return begin + int(kept[int(np.argmin(gradient))])


def draw(test: RangeTest, path: Path, title: str) -> Path:
    """lr_find.png: the loss of each step and the smoothed loss against the learning rate (log scale), the
    suggestion marked."""
    from ..outputs.plots import STYLE, plt, save_figure  # matplotlib: 0.4 s to import, needed only here

    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(test.lrs, test.losses, color="tab:blue", alpha=0.35, lw=1, label="training loss (each step)")
        ax.plot(test.lrs, test.smoothed, color="tab:blue", lw=2, label=f"smoothed (EMA, beta {BETA})")
        if test.suggestion is not None:
            at = test.lrs.index(test.suggestion)
            ax.axvline(test.suggestion, color="tab:red", lw=1, ls="--")
            ax.plot([test.suggestion], [test.smoothed[at]], "o", color="tab:red",
                    label=f"suggestion {test.suggestion:.1e} (steepest descent)")
        ax.set_xscale("log")
        if test.losses:  # the smoothed curve whole; single steps far above it cut off (they would flatten it)
            low, high = min(test.losses), max(test.smoothed)
            ax.set_ylim(low - 0.05 * (high - low), high + 0.25 * (high - low))
        ax.set(title=f"Learning-rate range test: {title}", xlabel="learning rate (log scale)",
               ylabel="training loss (mean over all processes)")
        ax.legend()
        return save_figure(fig, path)
