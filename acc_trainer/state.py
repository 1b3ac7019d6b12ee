"""Where a run stands: the progress checkpoints save and load, and the clock of the training time.

`RunState` is everything of the loop's progress besides what `accelerator.save_state` writes (model,
optimizer, scheduler, RNGs): the step, the evaluations so far, the best one, steps skipped and the
losses of the current log interval. The position in the data is the step: every epoch has exactly
`steps_per_epoch` steps, so nothing else is needed to continue where a run stopped.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator


class IntervalLosses:
    """The micro-batch losses of the current log interval, kept on the device.

    No host sync per step (each loss is only detached and kept): read at log steps and checkpoints,
    with one copy to the host, it gives each process's mean loss over the interval, and the first step
    whose loss was NaN or inf (from where the interval began).
    """

    def __init__(self, grad_accum: int, device: torch.device):
        self.grad_accum, self.device, self.first_step = grad_accum, device, 1
        self.values: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        self.values.append(loss.detach())

    def restart(self, step: int) -> None:
        """A new interval, whose first step is step + 1."""
        self.values, self.first_step = [], step + 1

    def _local(self) -> list[float]:
        return torch.stack(self.values).float().tolist() if self.values else []

    def read(self, accelerator: Accelerator) -> tuple[list[float], int | None]:
        """Every process's mean loss over the interval's finite losses, and the first step with a NaN/inf
        loss on any process, or None (one gather of two numbers per process; none on one process)."""
        local = self._local()
        finite = [v for v in local if math.isfinite(v)]
        first_bad = next((i for i, v in enumerate(local) if not math.isfinite(v)), -1)
        row = [sum(finite) / max(len(finite), 1), first_bad]
        rows = [row] if accelerator.num_processes == 1 else accelerator.gather(
            torch.tensor([row], dtype=torch.float64, device=self.device)).tolist()
        bad = [int(b) for _, b in rows if b >= 0]
        return [m for m, _ in rows], (self.first_step + min(bad) // self.grad_accum if bad else None)

    def last_step_nonfinite(self, accelerator: Accelerator) -> bool:
        """Whether the step just made had a NaN/inf loss on any process (a host sync: --skip-nonfinite only)."""
        recent = torch.stack(self.values[-self.grad_accum:])
        return bool(accelerator.reduce((~torch.isfinite(recent)).sum().float(), "sum").item() > 0)

    def state(self, accelerator: Accelerator) -> dict:
        """For a checkpoint: every process's losses so far in the interval (all processes call this; every
        process has made as many micro-batches)."""
        if not self.values:
            return {"first_step": self.first_step, "count": 0, "values": [[]] * accelerator.num_processes}
        local = torch.tensor(self._local(), dtype=torch.float32, device=self.device)
        return {"first_step": self.first_step, "count": len(self.values),
                "values": accelerator.gather(local[None]).tolist()}

    def load(self, state: dict, process_index: int) -> None:
        self.first_step = state["first_step"]
        mine = state["values"][process_index][: state["count"]]
        self.values = [torch.tensor(v, dtype=torch.float32, device=self.device) for v in mine]


@dataclass
class RunState:
    """The loop's progress. `saved` gives what a checkpoint keeps of it, `load` puts it back."""

    losses: IntervalLosses
    step: int = 0  # optimizer steps made
    skipped_steps: int = 0  # --skip-nonfinite: steps whose loss was NaN/inf, no update made
    bad_sample_steps: int = 0  # --skip-bad-samples: steps with an unreadable sample, no update made
    loss_scale_skipped_steps: int = 0  # fp16: steps the grad scaler skipped (overflow)
    unreadable_samples: list[str] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # every evaluation's results, with step and epoch
    best: dict | None = None  # --save-best: {"step", "metric", "value"}
    unreadable_now: list[int] = field(default_factory=list)  # this step's unreadable indices, not saved

    SAVED = ("step", "skipped_steps", "bad_sample_steps", "loss_scale_skipped_steps", "unreadable_samples", "evals",
             "best")

    def saved(self, accelerator: Accelerator) -> dict:
        """For a checkpoint (every process calls this: the losses are gathered)."""
        return {**{name: getattr(self, name) for name in self.SAVED}, "losses": self.losses.state(accelerator)}

    def load(self, saved: dict, process_index: int) -> None:
        for name in self.SAVED:  # checkpoints written before a field existed keep its default
            if name in saved:
                setattr(self, name, saved[name])
        self.losses.load(saved["losses"], process_index)


@dataclass
class Clock:
    """Training time, and how much of it was spent waiting for data; evaluation, logging and checkpoints
    are not counted. `interval` reads the time since the last log step; `restart` begins the next one."""

    logged_step: int = 0
    train_time: float = 0.0  # over the logged intervals
    data_time: float = 0.0
    data_wait: float = 0.0  # in the current interval
    interval_start: float = field(default_factory=time.perf_counter)
    batch_ready: float = field(default_factory=time.perf_counter)

    def interval(self, step: int) -> tuple[float, int, float]:
        """(seconds, steps, seconds waiting for data) since the last log step, counted into the totals."""
        elapsed, steps, waited = time.perf_counter() - self.interval_start, step - self.logged_step, self.data_wait
        self.train_time, self.data_time = self.train_time + elapsed, self.data_time + waited
        self.logged_step, self.data_wait = step, 0.0
        return elapsed, steps, waited

    def restart(self) -> None:
        """The next interval starts now (after the logging, which is not training time)."""
        self.interval_start = time.perf_counter()

    def exclude(self, since: float) -> None:
        """Time since `since` (an evaluation, say) is not training time."""
        self.interval_start += time.perf_counter() - since
