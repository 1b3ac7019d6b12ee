"""Where a run stands: the progress checkpoints save and load, and the clock of the training time.

`RunState` is everything of the loop's progress besides what `accelerator.save_state` writes (model,
optimizer, scheduler, RNGs): the step, the evaluations so far, the best one, steps skipped and the
losses of the current log interval. The position in a map-style dataset is the step: every epoch has
exactly `steps_per_epoch` steps, so nothing else is needed to continue where a run stopped; a stream's
position (its epoch, the samples read in it, its own saved state) is kept besides (streams.py).

Setup's stages of the run's state are here too: the optimizer, its schedule and the run's length (`schedule`,
`Shape`), and the state a run starts with, new or loaded from a checkpoint through the engine's room (`started`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator

from ..config import ConfigError, TrainConfig
from ..data.datasets import steps_per_epoch
from ..distributed import engines
from ..language import adapters
from ..outputs import checkpoints
from ..workload.measure import StepGaps
from ..workload.optim import build_optimizer, build_scheduler, param_groups


@dataclass
class Interval:
    """What `IntervalLosses.read` gives: the loss over the interval (over every process: a mean of the
    micro-batch means, or the sum over every item divided by their count), each process's, the named
    parts of a model's loss dict, and the first step whose loss was NaN/inf (or None)."""

    loss: float
    per_rank: list[float]
    parts: dict[str, float]
    bad: int | None


class IntervalLosses:
    """The micro-batch losses of the current log interval, kept on the device.

    No host sync per step (each loss is only detached and kept): read at log steps and checkpoints,
    with one copy to the host. A micro-batch's loss is a mean over its samples, or a sum over its items
    with their count (losses.Loss), and may come with named parts (a model's loss dict).
    """

    def __init__(self, grad_accum: int, device: torch.device, counted: bool = False):
        self.grad_accum, self.device, self.first_step, self.counted = grad_accum, device, 1, counted
        self.values: list[torch.Tensor] = []
        self.items: list[torch.Tensor] = []  # each micro-batch's item count, for losses summed over items
        # Each mean's weight, where not all are 1: the first interval of a run continued on another number of
        # processes holds means over shares of another size (load).
        self.weights: list[float] = []
        self.carried = (0, 0)  # rows loaded from a checkpoint, and the steps they cover (load)
        self.parts: list[torch.Tensor] = []  # each micro-batch's named losses, stacked
        self.part_names: list[str] = []

    def add(self, loss) -> None:
        if (loss.items is not None) != self.counted:
            raise ValueError("the loss returned one number for some batches and (sum, count) for others; it must "
                             "return the same form for every batch")
        self.values.append(loss.value.detach())
        if self.weights:
            self.weights.append(1.0)
        if loss.items is not None:
            self.items.append(loss.items)
        if loss.parts:
            self.parts.append(torch.stack([v.detach() for v in loss.parts.values()]))
            self.part_names = list(loss.parts)

    def step_items(self) -> torch.Tensor:
        """The items of the step just made, on this process (a device tensor: no sync)."""
        return torch.stack(self.items[-self.grad_accum:]).sum()

    def restart(self, step: int) -> None:
        """A new interval, whose first step is step + 1."""
        self.values, self.items, self.parts, self.weights, self.first_step = [], [], [], [], step + 1
        self.carried = (0, 0)

    def _rows(self) -> list[list[float]]:
        """One row per micro-batch: [loss, items (1 for a mean), *parts], on the host."""
        if not self.values:
            return []
        if not (self.items or self.weights or self.parts):  # means of equal weight: one copy to the host (7 us, not 19)
            return [[value, 1.0] for value in torch.stack(self.values).tolist()]
        columns = [torch.stack(self.values).double()]
        columns.append(torch.stack(self.items).double() if self.items else
                       torch.tensor(self.weights, dtype=torch.float64, device=columns[0].device) if self.weights else
                       torch.ones_like(columns[0]))
        if self.parts:
            columns.append(torch.stack(self.parts).double().T)
        return torch.cat([c.reshape(-1, len(self.values)) for c in columns]).T.tolist()

    def read(self, accelerator: Accelerator) -> Interval:
        """The interval's loss over its finite micro-batches, and the first step with a NaN/inf loss on any
        process (one gather of a few numbers per process; none on one process)."""
        rows = self._rows()
        finite = [row for row in rows if all(math.isfinite(v) for v in row)]
        first_bad = next((i for i, row in enumerate(rows) if not math.isfinite(row[0])), -1)
        if first_bad >= 0:  # as a count of micro-batches from the interval's start (loaded rows cover carried[1] steps)
            rows_in, steps_in = self.carried
            first_bad = steps_in * self.grad_accum + (first_bad - rows_in) if first_bad >= rows_in else first_bad
        width = 2 + len(self.part_names)
        if not self.counted:  # means: each weighs its row's weight (1 but after a resume on other processes)
            finite = [[row[0] * row[1], row[1], *(part * row[1] for part in row[2:])] for row in finite]
        totals = [sum(row[i] for row in finite) for i in range(width)] if finite else [0.0] * width
        mine = [*totals, first_bad]
        ranks = [mine] if accelerator.num_processes == 1 else accelerator.gather(
            torch.tensor([mine], dtype=torch.float64, device=self.device)).tolist()
        # Each rank's loss total and count (its items, or its micro-batches for means): every item counts once.
        count = sum(r[1] for r in ranks) or 1.0
        parts = {name: sum(r[2 + i] for r in ranks) / count for i, name in enumerate(self.part_names)}
        bad = [int(r[-1]) for r in ranks if r[-1] >= 0]
        return Interval(sum(r[0] for r in ranks) / count, [r[0] / r[1] if r[1] else 0.0 for r in ranks], parts,
                        self.first_step + min(bad) // self.grad_accum if bad else None)

    def last_step_nonfinite(self, accelerator: Accelerator) -> bool:
        """Whether the step just made had a NaN/inf loss on any process (a host sync: --skip-nonfinite only)."""
        recent = torch.stack(self.values[-self.grad_accum:])
        return bool(accelerator.reduce((~torch.isfinite(recent)).sum().float(), "sum").item() > 0)

    def state(self, accelerator: Accelerator) -> dict:
        """For a checkpoint: every process's losses so far in the interval (all processes call this). Rows of
        [loss, items, *parts] when there are items or parts, else the losses alone (the format of checkpoints
        from before items and parts). Processes hold as many micro-batches, except in the first interval of a
        run continued on another number of processes (`load`): each keeps its own count."""
        world = accelerator.num_processes
        mine = [len(self.values), int(bool(self.weights))]
        everyone = [mine] if world == 1 else accelerator.gather(torch.tensor([mine], device=self.device)).tolist()
        counts = [int(row[0]) for row in everyone]
        if not any(counts):
            return {"first_step": self.first_step, "count": 0, "values": [[]] * world,
                    "part_names": self.part_names, "items": self.counted}
        plain = not self.counted and not self.part_names and not any(row[1] for row in everyone)
        if self.values:
            rows = torch.tensor(self._rows(), dtype=torch.float64, device=self.device)
            local = rows[:, 0].float() if plain else rows
        else:
            local = torch.zeros((0,) if plain else (0, 2 + len(self.part_names)),
                                dtype=torch.float32 if plain else torch.float64, device=self.device)
        if world > 1 and len(set(counts)) > 1:
            local = accelerator.pad_across_processes(local, dim=0)
        everything = local[None].tolist() if world == 1 else accelerator.gather(local[None]).tolist()
        return {"first_step": self.first_step, "count": max(counts), "counts": counts,
                "values": [rows[:n] for rows, n in zip(everything, counts, strict=True)], "part_names": self.part_names,
                "items": self.counted}

    def load(self, state: dict, process_index: int, world: int | None = None) -> None:
        """This process's losses of the interval. Continued on another number of processes, process i takes
        those of every old process j with j % world == i (one after the other): the interval's totals and
        counts stay whole, only its per-process split changes. A mean over an old process's share weighs
        (new processes / old processes) of a mean over a new one's, so that every sample weighs the same."""
        self.first_step = state["first_step"]
        saved = state["values"]
        counts = state.get("counts") or [state["count"]] * len(saved)
        scale = 1.0 if world is None else world / len(saved)
        if world is None or world == len(saved):
            mine = saved[process_index][: counts[process_index]]
        else:
            mine = [row for j in range(process_index, len(saved), world) for row in saved[j][: counts[j]]]
        self.part_names = state.get("part_names", [])
        if mine and self.counted != bool(state.get("items")):
            # Written by a version that did not count this loss's items: its means cannot join the interval's sums.
            self.values, self.items, self.parts = [], [], []
        elif mine and isinstance(mine[0], list):  # rows of [loss, items, *parts]
            self.values = [torch.tensor(row[0], dtype=torch.float32, device=self.device) for row in mine]
            self.items = [torch.tensor(row[1], dtype=torch.float64, device=self.device) for row in mine] \
                if state.get("items") else []
            self.weights = [] if state.get("items") else [row[1] * scale for row in mine]
            self.parts = [torch.tensor(row[2:], dtype=torch.float32, device=self.device) for row in mine] \
                if self.part_names else []
        else:
            self.values = [torch.tensor(v, dtype=torch.float32, device=self.device) for v in mine]
            self.items, self.parts, self.weights = [], [], [scale] * len(mine)
        if self.weights and all(w == 1.0 for w in self.weights):
            self.weights = []
        # A checkpoint never holds a NaN/inf loss; a later one is counted from the steps these rows cover.
        self.carried = (len(self.values), max(counts) // self.grad_accum)


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
    early_best: float | None = None  # --early-stop: the best value so far
    stale_evals: int = 0  # --early-stop: evaluations since it last improved
    stopped_early: dict | None = None  # --early-stop: why and where the run stopped
    stream: dict | None = None  # a stream's position: epoch, start (its first step), samples, state, epoch_steps
    unreadable_now: list[int] = field(default_factory=list)  # this step's unreadable indices, not saved

    SAVED = ("step", "skipped_steps", "bad_sample_steps", "loss_scale_skipped_steps", "unreadable_samples", "evals",
             "best", "early_best", "stale_evals", "stopped_early", "stream")

    def saved(self, accelerator: Accelerator) -> dict:
        """For a checkpoint (every process calls this: the losses are gathered)."""
        return {**{name: getattr(self, name) for name in self.SAVED}, "losses": self.losses.state(accelerator)}

    def load(self, saved: dict, process_index: int, world: int | None = None) -> None:
        """`world`: this run's processes, when the checkpoint's were another number (IntervalLosses.load)."""
        for name in self.SAVED:  # checkpoints written before a field existed keep its default
            if name in saved:
                setattr(self, name, saved[name])
        self.losses.load(saved["losses"], process_index, world)


@dataclass
class Clock:
    """Training time, and how much of it the device spent waiting for data (measure.StepGaps); evaluation, logging
    and checkpoints are not counted. `interval` reads the time since the last log step; `restart` begins the next."""

    gaps: StepGaps
    logged_step: int = 0
    train_time: float = 0.0  # over the logged intervals
    data_time: float = 0.0
    interval_start: float = field(default_factory=time.perf_counter)
    batch_ready: float = field(default_factory=time.perf_counter)

    def batch_arrived(self) -> None:
        """A micro-batch is on the device: its wait is data time (the device's own, on a GPU)."""
        self.gaps.began(time.perf_counter() - self.batch_ready)

    def batch_done(self) -> None:
        """The micro-batch's work is queued; the loop now asks for the next batch."""
        self.gaps.ended()
        self.batch_ready = time.perf_counter()

    def paused(self, forget: bool = False) -> None:
        """The host's wait for the next batch starts now (after the step's bookkeeping); `forget`: after a pause of
        the device's work too (a checkpoint, an epoch's end), whose gap is not data time."""
        if forget:
            self.gaps.forget()
        self.batch_ready = time.perf_counter()

    def interval(self, step: int) -> tuple[float, int, float]:
        """(seconds, steps, seconds waiting for data) since the last log step, counted into the totals."""
        elapsed, steps, waited = time.perf_counter() - self.interval_start, step - self.logged_step, self.gaps.read()
        self.train_time, self.data_time = self.train_time + elapsed, self.data_time + waited
        self.logged_step = step
        return elapsed, steps, waited

    def restart(self) -> None:
        """The next interval starts now (after the logging, which is not training time)."""
        self.interval_start = time.perf_counter()
        self.gaps.forget()

    def exclude(self, since: float) -> None:
        """Time since `since` (an evaluation, say) is not training time."""
        self.interval_start += time.perf_counter() - since
        self.gaps.forget()


@dataclass
class Shape:
    """How long the run is, in optimizer steps; a stream's is learnt in its first epoch (`learn`)."""

    total_steps: int | None  # None: --epochs over a stream whose length is learnt in its first epoch
    per_epoch: int | None  # None: not known yet (a stream)
    epochs: int | None  # None: --max-steps over a stream of unknown length
    checkpoint_steps: int | None  # --checkpoint-every N (steps), parsed once
    start_step: int  # the checkpoint's step when resuming, else 0

    def learn(self, steps: int) -> None:
        self.per_epoch = steps
        if self.total_steps is None:
            self.total_steps = self.epochs * steps
        self.epochs = self.epochs or math.ceil(self.total_steps / max(steps, 1))


def schedule(cfg: TrainConfig, model, job, resumed: dict | None, engine: engines.Engine) -> tuple:
    """The optimizer, the LR schedule over the run's optimizer steps (--max-steps wins over --epochs) and the
    run's shape. A stream that does not say its length has it learnt in its first epoch (kept in
    checkpoints): until then the run's length is unknown, which a schedule over the run's length cannot
    start without (`step` counts epochs: it needs the epoch's length)."""
    per_epoch = steps_per_epoch(job.data, cfg)  # a step per loader batch, or --num-iterations (GRPO)
    per_epoch = per_epoch * job.objective.iterations if per_epoch else ((resumed or {}).get("stream") or {}).get("epoch_steps")
    total_steps = cfg.max_steps or (cfg.epochs * per_epoch if per_epoch else None)
    if total_steps is None and (job.scheduler or cfg.scheduler not in ("constant",)):
        raise ConfigError(f"--scheduler {cfg.scheduler if not job.scheduler else 'factory'} needs the run's length, and the "
                          f"stream of {job.dataset_name} does not say how many samples it has (no __len__): give "
                          "--max-steps, or --scheduler constant")
    if per_epoch is None and cfg.scheduler == "step" and not job.scheduler:
        raise ConfigError(f"--scheduler step decays every --lr-step-epochs epochs, and the stream of {job.dataset_name} "
                          "does not say how many samples it has (no __len__), so its epochs' length is not known in "
                          "advance: use --scheduler cosine or onecycle with --max-steps, or give the stream a __len__")
    lr = cfg.lr * cfg.batch_size / cfg.lr_reference_batch if cfg.scale_lr else cfg.lr
    optimizer = build_optimizer(cfg, param_groups(cfg, model, lr), lr, job.optimizer,
                                fused=cfg.fused_optimizer and not engine.shards)
    scheduler = build_scheduler(cfg, optimizer, lr, total_steps, per_epoch, job.scheduler)
    epochs = math.ceil(total_steps / per_epoch) if per_epoch else None if cfg.max_steps else cfg.epochs
    return optimizer, scheduler, Shape(total_steps, per_epoch, epochs, cfg.checkpoint_steps, 0)


def started(cfg: TrainConfig, accelerator: Accelerator, job, origin, trained, items: bool, shape: Shape,
            engine: engines.Engine) -> RunState:
    """The run's progress: new, or the checkpoint's (its weights, optimizer, scheduler, random states and state
    loaded into the prepared objects; from another engine's checkpoint through its room, distributed/engines/)."""
    state = RunState(IntervalLosses(cfg.grad_accum, accelerator.device, items))
    if job.data.kind.train.stream:
        state.stream = stream_position(0, 0, shape.per_epoch)
    if origin.resumed:
        partial = bool(origin.resumed.get("frozen"))  # the frozen weights are not in it: built again above
        saved_world, saved = origin.resumed["world_size"], engines.of(origin.resumed["engine"])
        if partial:
            engine.check_holds_trainable(origin.resume, accelerator.unwrap_model(trained.model, keep_torch_compile=False),
                                         adapters.check_holds_trainable)
        with checkpoints.reading(origin.resume):
            if saved.name != engine.name:
                engine.move_in(accelerator, trained.model, trained.optimizer, trained.scheduler, origin.resume, saved, partial)
                checkpoints.restore_random_states(origin.resume, min(accelerator.process_index, saved_world - 1))
            else:
                engine.load_checkpoint(accelerator, origin.resume, partial)
        checkpoints.check_random_states(accelerator, origin.resume, saved_world)
        state.load(origin.resumed, accelerator.process_index, accelerator.num_processes)
    return state


def stream_position(epoch: int, start: int, epoch_steps: int | None) -> dict:
    """A stream's position at the start of `epoch` (which begins after optimizer step `start`), as checkpoints
    keep it; the loader moves `samples` and `state` on as it hands out each step (streams.StreamLoader.epoch)."""
    return {"epoch": epoch, "start": start, "samples": 0, "state": None, "epoch_steps": epoch_steps}
