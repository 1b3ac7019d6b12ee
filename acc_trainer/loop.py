"""The training loop: the same on a CPU, one GPU, many GPUs and many machines.

`train(config)` trains what the options name (built-in names or import paths, resolved in
components.py); `fit(model, train_data, ...)` trains a user's own objects. Both end in `run()`, which
reads like a recipe: `setup` -> `train_epoch` -> `evaluate` -> `finish`. Accelerate does every
distributed step, each one visible in this file: `Accelerator(...)` picks devices, processes and
precision; `prepare` wraps the model (DDP when there are several processes, or FSDP / DeepSpeed when
the accelerate config selects them: see engines.py), the optimizer, the scheduler and the data loaders
(each process gets its slice of every global batch); `accumulate` + `backward` handle gradient
accumulation and loss scaling; `gather_for_metrics` and `reduce` make evaluation exact;
`save_state` / `load_state` write and read checkpoints; `save_model` writes the final weights.

How batches are counted: `--batch-size` is the GLOBAL batch of one optimizer step. The training
loader yields global micro-batches of batch_size / grad_accum samples, and Accelerate
(`split_batches=True`) hands each of the N processes 1/N of every one. So 1 process, or 2, or 2 with
accumulation, all see the same samples at every optimizer step, and the LR schedule counts
optimizer steps whatever the topology.

The run's progress (step, evaluations, best, skipped steps, losses) is one `RunState` (state.py),
saved in every checkpoint; the prepared objects are one `Run`, built by `setup`.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import (DistributedDataParallelKwargs, DistributedType, ProjectConfiguration, TorchDynamoPlugin,
                              find_batch_size, gather_object, recursively_apply, send_to_device, set_seed)
from safetensors.torch import load_file

from . import augment as augmentation
from . import checkpoints, components, engines, processes, speedups, streams
from .checkpoints import BEST, Checkpoints, WRITE_ERRORS, write_failure
from .components import Checked, Workload, first_samples, metric_input
from .config import ConfigError, TrainConfig, make_config
from .data import Uncollated, reads_files, sample_name, steps_per_epoch
from .loaders import build_loaders, dataloader_config, on_device
from .losses import Loss, as_loss, cross_entropy, forward, model_loss
from .metrics import Stateful, is_stateful
from .measure import device_peak_flops, flops_per_sample, library_versions, peak_memory_mb
from .models import sync_batchnorm
from .optim import build_optimizer, build_scheduler, param_groups
from .progress import Progress, format_metric, summary_table
from .runfiles import RunFiles, lock_run_folder, output_dir
from .state import Clock, IntervalLosses, RunState
from .stopping import StopSignals, TrainingStopped
from .streams import StreamLoader, StreamUnreadable


def train(cfg: TrainConfig) -> dict:
    """Train what `cfg` names; every process calls this. Returns the run summary (also in summary.json).

    Raises ConfigError for bad input and TrainingStopped when a signal or a NaN/inf loss stops the run.
    """
    cfg.validate()
    streams.forget()
    processes.start(cfg)
    set_seed(cfg.seed)  # the same initial weights and generated data on every process
    return run(cfg, components.build_workload(cfg))


def fit(model, train_data, eval_data=None, *, loss=None, metrics=None, collate_fn=None, forward=None,
        optimizer=None, scheduler=None, config: TrainConfig | None = None, **options) -> dict:
    """Train `model` (a plain nn.Module) on `train_data`, evaluating on `eval_data` after every epoch.

    Datasets are map-style and yield `(inputs, targets)` or dicts of tensors (the model is then
    called as `model(**batch)`, targets are `batch["labels"]`). `loss`: a function
    `loss(outputs, targets) -> scalar` or a built-in name; None uses the model's own loss when its
    outputs carry one, else cross-entropy for integer targets and MSE for real ones; a loss may return
    `(sum, count)` over items (tokens, boxes), normalised over the whole global batch (losses.py).
    `metrics`: a dict of name -> `metric(outputs, targets)` (one value per sample) or built-in names.
    `collate_fn(samples) -> batch` batches samples of different sizes; `forward(model, batch) ->
    (outputs, targets)` replaces the default model call (or "with_targets"). `optimizer`: a name or
    `factory(param_groups) -> Optimizer`; `scheduler`: a name or `factory(optimizer, total_steps)`. `options`
    are TrainConfig fields (`epochs=3, batch_size=256, init_from="w.pt", ...`), applied over `config`. Every
    process of a launch calls this with the same arguments; returns the run summary.
    """
    streams.forget()
    factories = {}
    for name, given, kind in (("optimizer", optimizer, torch.optim.Optimizer),
                              ("scheduler", scheduler, torch.optim.lr_scheduler.LRScheduler)):
        if isinstance(given, kind):
            raise ConfigError(f"fit: {name}= takes a name or a factory ({'factory(param_groups)' if name == 'optimizer' else 'factory(optimizer, total_steps)'}), "
                              f"not a {type(given).__name__} object: the trainer builds the parameter groups")
        if isinstance(given, str):
            options[name] = given
        elif given is not None:
            factories[name] = components._callable(given, repr(given), f"fit: {name}")
    cfg = fit_config(model, train_data, config, options, collate_fn, forward)
    job = components.from_objects(model, train_data, eval_data, loss, metrics, collate_fn or cfg.collate,
                                  forward or cfg.forward)
    job.optimizer, job.scheduler = factories.get("optimizer"), factories.get("scheduler")
    return run(cfg, job)


def fit_config(model, train_data, config: TrainConfig | None, options: dict, collate_fn=None,
               forward=None) -> TrainConfig:
    """`config` with `options` over it, naming the model and data by their classes (and the collate and
    forward functions by their import paths, when they have one)."""
    values = config.to_dict() if config is not None else {}
    unknown = sorted(set(options) - set(TrainConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"fit: unknown option {unknown[0]!r} (options are TrainConfig fields, e.g. epochs, batch_size)")
    values.update(options)
    values["model"], values["dataset"] = components.qualified_name(model), components.qualified_name(train_data)
    for name, fn in (("collate", collate_fn), ("forward", forward)):
        if fn is not None:
            values[name] = fn if isinstance(fn, str) else components.function_name(fn)
    return make_config(values)


def batch_loss(model, batch, loss_fn: Callable, forward_fn: Callable | None = None) -> tuple[Any, Any, Loss | None]:
    """How one batch becomes the model's outputs, the batch's targets and the loss: the one place, for
    training and evaluation alike. `forward_fn(model, batch) -> (outputs, targets)` is the user's
    (fit(forward=), --forward), else losses.forward. The loss is a losses.Loss (`loss_fn` may return one
    number or (sum, count) too), or None when the outputs carry none (a model that returns predictions
    in evaluation)."""
    outputs, targets = (forward_fn or forward)(model, batch)
    loss = loss_fn(outputs, targets) if loss_fn is not None else None
    return outputs, targets, loss if loss is None or isinstance(loss, Loss) else as_loss(loss)


# ----------------------------------------------------------------------------------------- the recipe


def run(cfg: TrainConfig, job: Workload) -> dict:
    """The training loop, on the objects of `job`: the model, the data, the loss and the metrics."""
    r = setup(cfg, job)
    state = r.state
    where = lambda: (f"epoch {r.epoch + 1}, after optimizer step {state.step}, process "
                     f"{r.accelerator.process_index} of {r.world}")
    with r.progress, StopSignals(r.accelerator) as signals, r.files.plots_if_stopped(cfg.plots), _naming_the_step(where):
        for epoch in epochs_left(r):
            r.epoch = epoch
            if not _epoch_trained(r, epoch):  # else: resumed before this epoch's evaluation
                with _stream_faults(r, "training"):
                    train_epoch(r, signals)
            # Evaluate after every epoch (and after the last step when --max-steps ends mid-epoch).
            since = time.perf_counter()
            if r.eval_loader is not None:
                with _stream_faults(r, "evaluation"):
                    results = evaluate(r.accelerator, r.ema.module if r.ema else r.model, r.eval_loader,
                                       r.eval_loss_fn, r.metrics, cfg.channels_last, r.input_dtype,
                                       guarded=reads_files(r.job.data.eval), forward_fn=r.job.forward, tables=r.tables)
                keep_evaluation(r, results)
            if r.streaming and state.stream.get("ended"):  # evaluated: a checkpoint from here starts the next epoch
                state.stream = stream_position(epoch + 1, state.step, state.stream["epoch_steps"])
            if cfg.checkpoint_epochs or (r.checkpoint_steps and state.step % r.checkpoint_steps == 0):
                save_checkpoint(r)
            r.clock.exclude(since)  # evaluation is not training time
            stop_if_signalled(r, signals)
            if state.stopped_early:  # --early-stop: decided alike on every process (keep_evaluation)
                break
    return finish(r)


def epochs_left(r: "Run"):
    """The epochs to train, from the checkpoint's when resuming: a checkpoint at the very end after the final
    evaluation leaves none; one between an epoch's last step and its evaluation (the evaluation failed)
    resumes into that epoch, to evaluate it. A stream's epoch ends where the stream ends; with --max-steps
    and a stream of unknown length, epochs follow each other until the last step."""
    state = r.state
    finished = r.total_steps is not None and state.step >= r.total_steps
    evaluated = r.eval_loader is None or bool(state.evals) and state.evals[-1]["step"] == state.step
    if state.stopped_early or (finished and evaluated):
        return
    if r.streaming:
        epoch = state.stream["epoch"]
    elif state.step and (finished or state.step % r.per_epoch == 0) and not evaluated:
        epoch = (state.step - 1) // r.per_epoch  # its steps are done, its evaluation is not (it failed)
    else:
        epoch = state.step // r.per_epoch
    while r.epochs is None or epoch < r.epochs:
        yield epoch
        if state.stopped_early or (r.total_steps is not None and state.step >= r.total_steps):
            return
        epoch += 1


def stream_position(epoch: int, start: int, epoch_steps: int | None) -> dict:
    """A stream's position at the start of `epoch` (which begins after optimizer step `start`), as checkpoints
    keep it; the loader moves `samples` and `state` on as it hands out each step (streams.StreamLoader.epoch)."""
    return {"epoch": epoch, "start": start, "samples": 0, "state": None, "epoch_steps": epoch_steps}


def _epoch_trained(r: "Run", epoch: int) -> bool:
    """Whether the steps of `epoch` are all made: resumed from a checkpoint between its last step and its
    evaluation (a stream's end is marked in its position, see _stream_ended)."""
    if r.total_steps is not None and r.state.step >= r.total_steps:
        return True
    return bool(r.state.stream.get("ended")) if r.streaming else r.state.step >= (epoch + 1) * r.per_epoch


@contextmanager
def _stream_faults(r: "Run", split: str):
    """A stream that cannot be read stops every process at the same step (its loader agrees on it),
    after a checkpoint of the last whole step, with one line."""
    try:
        yield
    except StreamUnreadable as e:
        r.optimizer.zero_grad()
        _checkpoint_this_step(r)
        raise TrainingStopped(f"{e}, at step {r.state.step + (split == 'training')}; checkpoint saved in "
                              f"{r.checkpoints.last}; continue with --resume auto --output-dir {r.out} once it can be "
                              "read", code=1) from None


@dataclass
class Run:
    """What `setup` builds for the loop: the prepared objects, the run's shape and its files."""

    cfg: TrainConfig
    job: Workload
    accelerator: Accelerator
    engine: str  # DDP, FSDP or DEEPSPEED
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    loss_fn: Callable  # (outputs, targets) -> losses.Loss, one number or (sum, count)
    eval_loss_fn: Callable | None  # None: the evaluation outputs carry no loss (a detector's predictions)
    loss_name: str
    items: bool  # the loss is a sum over items, divided by the count of the whole global batch
    loss_per: str  # item, sample or position (components.Checked)
    item_scale: float  # items of one process's micro-batch, about (see normalise_gradients)
    unused: list[str]  # parameters the first samples left without a gradient
    tuning: dict  # --init-from's report, --freeze's parameters and norm layers (_fine_tuning)
    metrics: dict
    tables: dict  # metrics with state whose results are tables (the confusion matrix)
    augment: Any  # augment.Augment or None
    ema: Any  # torch.optim.swa_utils.AveragedModel of the trained weights, or None
    averaged: Any  # the module the EMA follows (the model without its wrappers)
    input_dtype: torch.dtype | None  # DeepSpeed's weights' dtype for floating inputs
    total_steps: int | None  # None: --epochs over a stream whose length is learnt in its first epoch
    per_epoch: int | None  # None: not known yet (a stream)
    epochs: int | None  # None: --max-steps over a stream of unknown length
    checkpoint_steps: int | None  # --checkpoint-every N (steps), parsed once
    flops: int  # per training sample
    parameters: dict  # name -> shape, recorded in checkpoints
    notes: list[str]
    out: Path
    resume: Path | None
    start_step: int  # the checkpoint's step when resuming, else 0
    files: RunFiles
    checkpoints: Checkpoints
    progress: Progress
    state: RunState
    clock: Clock
    started: float
    epoch: int = 0
    stream_resume: dict | None = None  # how a resumed stream reached its position (streams.StreamLoader.resumed)
    last_tables: dict = None  # the last evaluation's tables: confusion_matrix, per_class

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def streaming(self) -> bool:  # the training set is a stream (streams.py)
        return isinstance(self.train_loader, StreamLoader)

    @property
    def per_process_batch(self) -> int:  # of one micro-batch
        return self.cfg.batch_size // (self.world * self.cfg.grad_accum)


# ----------------------------------------------------------------------------------------- setup


def setup(cfg: TrainConfig, job: Workload) -> Run:
    """Processes, the Accelerator, the pieces checked on one sample, `prepare`, the state (from a
    checkpoint when resuming), and only then the run folder: a failed start leaves nothing behind."""
    started = time.perf_counter()
    accelerator, engine, out, resume, resumed, checked = _accelerator(cfg, job)
    model, loss_fn, metrics, augment, flops, notes, shapes = _pieces(cfg, job, accelerator, engine, resume, resumed,
                                                                     checked)
    tuning = _fine_tuning(cfg, model, resumed)  # --init-from, --freeze (before the groups and prepare)
    notes += tuning["notes"]
    optimizer, scheduler, per_epoch, total_steps = _optimizer(cfg, model, job, resumed)
    world = accelerator.num_processes
    train_loader, eval_loader = build_loaders(cfg, job.data, world, accelerator.device, augment, job.collate,
                                              accelerator.process_index, processes.summing(accelerator), job.dataset_name)
    input_dtype = engines.prepare_deepspeed(accelerator, cfg.batch_size // (world * cfg.grad_accum))
    # Batches of tensors already on the training device need no copy: Accelerate's send_to_device would
    # still walk every batch (12 us of a 90 us step of a small model here). DeepSpeed and Megatron-LM refuse
    # the list; FSDP2 and tensor parallelism ignore it.
    placement = None if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM) else [
        None, None, *(False if on_device(loader, accelerator.device) else None for loader in (train_loader, eval_loader)),
        None]
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler, device_placement=placement
    )
    ema, averaged = _ema(cfg, accelerator, model)
    state = RunState(IntervalLosses(cfg.grad_accum, accelerator.device, checked.items))
    if isinstance(train_loader, StreamLoader):
        state.stream = stream_position(0, 0, per_epoch)
    if resumed:
        with checkpoints.reading(resume):
            accelerator.load_state(str(resume))
        checkpoints.check_random_states(accelerator, resume, resumed["world_size"])
        state.load(resumed, accelerator.process_index, world)
        notes += checkpoints.elastic_note(resumed["world_size"], world)
    # Startup succeeded: only now does the run write anything.
    processes.main_decides(lambda: lock_run_folder(out, resume is not None))
    files = RunFiles(out, enabled=accelerator.is_main_process, resumed_step=state.step if resumed else None)
    files.write_config(cfg)
    saver = Checkpoints(accelerator, out / "checkpoints", cfg.keep_last)
    saver.last = resume
    if cfg.log_with:
        accelerator.init_trackers("acc_trainer", config=_tracker_config(cfg))
    epochs = math.ceil(total_steps / per_epoch) if per_epoch else None if cfg.max_steps else cfg.epochs
    r = Run(cfg=cfg, job=job, accelerator=accelerator, engine=engine, model=model, optimizer=optimizer,
            scheduler=scheduler, train_loader=train_loader, eval_loader=eval_loader, loss_fn=loss_fn,
            eval_loss_fn=loss_fn if checked.eval_loss else None,
            loss_name=checked.loss_name, items=checked.items, loss_per=checked.loss_per, item_scale=checked.item_scale, unused=checked.unused,
            tuning=tuning,
            metrics=metrics, tables=checked.tables, augment=augment, ema=ema, averaged=averaged, input_dtype=input_dtype,
            total_steps=total_steps, per_epoch=per_epoch, epochs=epochs, checkpoint_steps=cfg.checkpoint_steps,
            flops=flops, parameters=shapes, notes=notes, out=out, resume=resume, start_step=state.step, files=files,
            checkpoints=saver, progress=Progress(cfg.progress, accelerator.is_main_process, total_steps, epochs,
                                                 per_epoch),
            state=state, clock=Clock(logged_step=state.step), started=started)
    streams.forget()  # the first samples read for the checks at start (up to a global batch) are not kept
    _announce(r)
    return r


def _accelerator(cfg: TrainConfig, job: Workload) -> tuple:
    """The processes, the run's folder, the checkpoint to resume from (checked), the first samples through
    the model and the loss (components.check_fit), and the Accelerator."""
    speedups.apply()
    partial_state, engine, cpu, timeout = processes.start(cfg)
    processes.warn_if_one_process_was_meant(partial_state)
    processes.check_topology(cfg, partial_state)
    out = output_dir(cfg, job.model_name, job.dataset_name)
    resume = checkpoints.find_resume(cfg, out)
    resumed = checkpoints.read_state(resume, cfg, partial_state.num_processes, engine) if resume else None
    world = partial_state.num_processes
    # Before the Accelerator: how DDP wraps the model depends on what the first samples show.
    checked = components.check_fit(job, cfg.batch_size // (world * cfg.grad_accum))
    if checked.items and engine == "DEEPSPEED":
        checked = _per_micro_batch(checked)
    # DDP fails at the second step when a parameter gets no gradient, unless it looks for such parameters
    # after every backward pass (a cost): asked for only when the first samples leave some unused.
    ddp = [DistributedDataParallelKwargs(find_unused_parameters=True)] if checked.unused and world > 1 else []
    if torch.cuda.is_available():  # TF32 tensor cores for float32 matmuls and convolutions (Ampere on)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=cfg.mixed_precision,  # None: the accelerate config's choice, else "no"
        dynamo_plugin=TorchDynamoPlugin(backend="inductor") if cfg.compile else None,
        gradient_accumulation_steps=cfg.grad_accum,
        log_with=_tracker(cfg.log_with),
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        dataloader_config=dataloader_config(cfg),
        kwargs_handlers=[timeout, *ddp],
        deepspeed_plugin=engines.deepspeed_plugin(cfg) if engine == "DEEPSPEED" else None,
    )
    engines.set_up(accelerator, engine)  # FSDP on CPU processes; no engine silently replaced
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "fp16":
        raise ConfigError("fp16 mixed precision needs a GPU; on a CPU use --mixed-precision bf16 or no")
    return accelerator, engine, out, resume, resumed, checked


def _per_micro_batch(checked: Checked) -> Checked:
    """Under DeepSpeed, which keeps the gradients to itself (they cannot be divided by the global batch's
    items): the model's own token loss stays a mean per micro-batch; a loss of (sum, count) is refused."""
    if checked.fn is not None:
        raise ConfigError(f"the loss {checked.loss_name} returns (sum, count), normalised over the global batch by scaling "
                          "the gradients, which DeepSpeed keeps to itself; use DDP or FSDP, or a mean loss")
    return replace(checked, loss=partial(model_loss, items=None), items=False, loss_per="position")


def _pieces(cfg: TrainConfig, job: Workload, accelerator: Accelerator, engine: str, resume, resumed,
            checked: Checked) -> tuple:
    """The model as it will train, its loss, metrics and augmentation (checked on the first samples)."""
    set_seed(cfg.seed)  # dropout and every other random number of the run start from --seed
    model, data, metrics = job.model, job.data, checked.metrics
    processes.check_same_data(accelerator, data)
    if resumed:
        checkpoints.check_model(resume, resumed, model)
    _check_save_best(cfg, checked, data)
    augment = augmentation.from_config(cfg, data)  # None, or each sample's from (seed, epoch, index)
    if job.collate and augment:
        raise ConfigError("--augment, --mixup and --cutmix work on batches of images (--augment auto: standard for "
                          "cifar10/cifar100); with --collate, give --augment none and augment in the dataset or the "
                          "collate function")
    loss_fn = _cross_entropy_options(cfg, checked, augment)
    if cfg.ema and engine != "DDP":
        raise ConfigError(f"--ema needs the whole model on every process; with {engine} each holds a shard")
    shapes = checkpoints.parameter_shapes(model)  # as the user built it: what a checkpoint must match
    # Counted on the main process only, so before BatchNorm layers become collective (--sync-bn).
    flops = flops_per_sample(model, first_samples(data.train, 1, job.collate), job.forward) \
        if accelerator.is_main_process else 0
    # Compared (and made equal, with a note) before `prepare`, whose DDP wrapper would silently copy
    # rank 0's weights over a seeding mistake.
    notes = processes.same_initial_weights(accelerator, model) + _notes(checked, model, accelerator.num_processes,
                                                                         engine)
    if cfg.sync_bn:
        model = sync_batchnorm(model, accelerator.device.type)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, loss_fn, metrics, augment, flops, notes, shapes


def _notes(checked: Checked, model, world: int, engine: str) -> list[str]:
    """What the first samples showed that a user should know: unused parameters, a loss that weighs
    micro-batches unequally, dropout on several processes."""
    notes = []
    if checked.unused:
        shown = ", ".join(checked.unused[:5]) + (f" and {len(checked.unused) - 5} more" if len(checked.unused) > 5 else "")
        notes.append(f"the forward never uses {shown} (no gradient from the first samples)" +
                     ("; DDP looks for unused parameters after every backward pass (find_unused_parameters)"
                      if world > 1 and engine == "DDP" else ""))
    if checked.loss_per == "position":
        notes.append(f"the loss {checked.loss_name} is a mean over each micro-batch's positions (tokens, pixels): where "
                     "their number varies (padding, labels of -100), micro-batches weigh unequally and training depends "
                     "on the number of processes and --grad-accum; return (sum, count) to count every position once")
    if world > 1 and any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        notes.append("the model has dropout: each process draws its own masks, so another number of processes trains on "
                     "the same samples with the same expected gradient, not the same masks")
    return notes


def _optimizer(cfg: TrainConfig, model, job: Workload, resumed: dict | None = None) -> tuple:
    """The optimizer and LR schedule, over the run's optimizer steps (--max-steps wins over --epochs). A stream
    that does not say its length has it learnt in its first epoch (kept in checkpoints): until then the
    run's length is unknown, which a schedule over the run's length cannot start without."""
    per_epoch = steps_per_epoch(job.data, cfg) or ((resumed or {}).get("stream") or {}).get("epoch_steps")
    total_steps = cfg.max_steps or (cfg.epochs * per_epoch if per_epoch else None)
    if total_steps is None and (job.scheduler or cfg.scheduler not in ("constant",)):
        raise ConfigError(f"--scheduler {cfg.scheduler if not job.scheduler else 'factory'} needs the run's length, and the "
                          f"stream of {job.dataset_name} does not say how many samples it has (no __len__): give "
                          "--max-steps, or --scheduler constant")
    lr = cfg.lr * cfg.batch_size / cfg.lr_reference_batch if cfg.scale_lr else cfg.lr
    optimizer = build_optimizer(cfg, param_groups(cfg, model, lr), lr, job.optimizer)
    return optimizer, build_scheduler(cfg, optimizer, lr, total_steps, per_epoch, job.scheduler), per_epoch, total_steps


def _fine_tuning(cfg: TrainConfig, model, resumed) -> dict:
    """--init-from (not when resuming: the checkpoint holds the weights) and --freeze. Parameters frozen for
    good stop needing gradients (DDP then leaves them out); ones that --unfreeze-at will train keep theirs,
    and their gradients are dropped before each step until then (so DDP syncs the same parameters all run,
    and an optimizer with weight decay leaves them untouched). BatchNorm layers whose parameters are all
    frozen keep their running statistics (evaluation mode while frozen)."""
    out = {"init": None, "frozen": [], "frozen_norms": [], "notes": []}
    if cfg.init_from and not resumed:
        report = checkpoints.initial_weights(model, cfg.init_from, cfg.init_strict)
        out["init"] = report
        out["notes"].append(f"init from {cfg.init_from}: {report['loaded']} tensors loaded" + "".join(
            f", {len(report[k])} {k} ({', '.join(report[k][:3])}{', ...' if len(report[k]) > 3 else ''})"
            for k in ("reset", "missing", "unexpected") if report[k]))
    if cfg.freeze:
        if cfg.unfreeze_at is not None and engines.requested() == "DEEPSPEED":
            raise ConfigError("--unfreeze-at: DeepSpeed steps its optimizer inside the backward pass, before frozen "
                              "gradients can be dropped; use DDP or FSDP, or --freeze alone")
        pattern = re.compile(cfg.freeze)
        names = {name for name, _ in model.named_parameters() if pattern.search(name)}
        if not names:
            raise ConfigError(f"--freeze {cfg.freeze!r} matches no parameter (names such as "
                              f"{next(iter(dict(model.named_parameters())), '-')!r})")
        for name, p in model.named_parameters():
            if name in names:
                out["frozen"].append(p)
                p.requires_grad_(cfg.unfreeze_at is not None)
        frozen = {id(p) for p in out["frozen"]}
        out["frozen_norms"] = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
                               and any(True for _ in m.parameters()) and all(id(p) in frozen for p in m.parameters())]
        out["notes"].append(f"frozen: {len(names)} parameters matching {cfg.freeze!r}"
                            + (f", trained from epoch {cfg.unfreeze_at}" if cfg.unfreeze_at else ""))
    return out


def _ema(cfg: TrainConfig, accelerator: Accelerator, model):
    """The exponential moving average of the weights: updated after every optimizer step, evaluated and
    saved in their place, and part of every checkpoint."""
    if not cfg.ema:
        return None, None
    averaged = accelerator.unwrap_model(model, keep_torch_compile=False)
    ema = torch.optim.swa_utils.AveragedModel(averaged, use_buffers=True,
                                              multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema))
    accelerator.register_for_checkpointing(ema)
    return ema, averaged


def _announce(r: Run) -> None:
    accelerator, cfg = r.accelerator, r.cfg
    r.progress.print(
        f"[bold]acc_trainer[/] {r.job.model_name} on {r.job.dataset_name}: {r.world} process(es) "
        f"({accelerator.distributed_type.value}, {accelerator.device.type}), precision {accelerator.mixed_precision}, "
        f"global batch {cfg.batch_size} = {r.world} x {cfg.grad_accum} x {r.per_process_batch}, "
        + (f"{r.total_steps} steps" if r.total_steps else "steps: as many as the stream gives (learnt in its first epoch)")
        + (f", resuming at step {r.state.step} from {r.resume}" if r.resume else "")
    )
    for note in r.notes:
        r.progress.print(note)


# ----------------------------------------------------------------------------------------- one epoch


def train_epoch(r: Run, signals: StopSignals) -> None:
    """The optimizer steps of epoch `r.epoch` (what is left of it, when resuming mid-epoch)."""
    cfg, accelerator, model, state, clock = r.cfg, r.accelerator, r.model, r.state, r.clock
    guarded, channels_last, input_dtype, loss_fn = reads_files(r.job.data.train), cfg.channels_last, r.input_dtype, r.loss_fn
    forward_fn, items = r.job.forward, r.items
    model.train()
    if _frozen_now(r):
        for norm in r.tuning["frozen_norms"]:
            norm.eval()  # their running statistics stay as they are
    if r.streaming:  # read from the stream's position (the loader moves it on as it hands out each step)
        r.progress.new_epoch(r.epoch, done=state.step - state.stream["start"], first_step=state.stream["start"])
        batches = r.train_loader.epoch(r.epoch, state.stream)
    else:
        r.progress.new_epoch(r.epoch, done=state.step - r.epoch * r.per_epoch)
        # The epoch seeds the shuffle; a resumed epoch skips the micro-batches it has already seen.
        seen = (state.step - r.epoch * r.per_epoch) * cfg.grad_accum
        batches = accelerator.skip_first_batches(r.train_loader, seen) if seen else r.train_loader
        batches.set_epoch(r.epoch)
    if r.augment:
        r.augment.set_epoch(r.epoch)  # and each sample's augmentation, whatever process or batch reads it
    clock.batch_ready = time.perf_counter()
    for batch in batches:
        clock.data_wait += time.perf_counter() - clock.batch_ready
        if guarded:  # (batch, indices of the samples that could not be read, else -1)
            batch, indices = batch
            state.unreadable_now += [i for i in indices if i >= 0]  # plain ints: no device sync
        batch = model_inputs(batch, channels_last, input_dtype)
        with accelerator.accumulate(model):
            _, _, loss = batch_loss(model, batch, loss_fn, forward_fn)
            if loss is None:
                raise ValueError("the model returned no loss in training (its outputs carry none)")
            # A sum over items is scaled to about a mean's size here; normalise_gradients divides by the count.
            accelerator.backward(loss.value / r.item_scale if items else loss.value)
            state.losses.add(loss)  # on the device; read back only at log steps and checkpoints
            if accelerator.sync_gradients:
                optimizer_step(r, guarded)
            r.optimizer.zero_grad()
        clock.batch_ready = time.perf_counter()
        if not accelerator.sync_gradients:
            continue
        state.step += 1
        r.progress.step()
        if r.streaming and r.train_loader.resumed and r.start_step == state.step - 1:
            _resumed_stream(r)
        if state.step % cfg.log_every == 0 or state.step == r.total_steps:
            log_interval(r)
        # At an epoch's last step, checkpoints and stops wait for that epoch's evaluation (a stream's last step
        # is known only once it ends: a checkpoint there resumes into the evaluation).
        if state.step == r.total_steps or (not r.streaming and state.step % r.per_epoch == 0):
            return
        if r.checkpoint_steps and state.step % r.checkpoint_steps == 0:
            save_checkpoint(r)
        stop_if_signalled(r, signals, check=state.step % cfg.log_every == 0)
        clock.batch_ready = time.perf_counter()  # logging and checkpoints are not waiting for data
    if r.streaming:
        _stream_ended(r)


def _stream_ended(r: Run) -> None:
    """The stream's epoch is over: its length is learnt from the first (the run's length then known). The
    position stays at the epoch's end (`ended`) until the epoch's evaluation is done (run), so that a
    checkpoint before it (the evaluation stream failed, say) resumes into that evaluation."""
    state, position = r.state, r.state.stream
    steps = state.step - position["start"]
    if r.per_epoch is None:
        r.per_epoch = position["epoch_steps"] = steps
        if r.total_steps is None:
            r.total_steps = r.epochs * steps
        r.epochs = r.epochs or math.ceil(r.total_steps / max(steps, 1))
        r.progress.learnt(r.total_steps, r.per_epoch, r.epochs)
    elif steps != r.per_epoch:
        r.progress.print(f"note: epoch {r.epoch + 1} of the stream had {steps} steps, the first {r.per_epoch}")
    position["ended"] = True


def _resumed_stream(r: Run) -> None:
    """How long the resumed stream took to reach its position, said once and kept for the summary."""
    how = r.train_loader.resumed
    r.stream_resume = how
    r.progress.print(f"stream resumed at sample {how['samples']:,} of epoch {r.epoch + 1}: "
                     + ("loaded its saved position" if how["how"] == "saved state" else "read again from the epoch's start")
                     + f" in {how['seconds']:.2f} s")


def optimizer_step(r: Run, guarded: bool) -> None:
    """The update at the end of an accumulation: skipped for a step with unreadable samples (with
    --skip-bad-samples) or a NaN/inf loss (with --skip-nonfinite), else clip, step, schedule, EMA."""
    cfg, accelerator, state = r.cfg, r.accelerator, r.state
    bad = _unreadable_everywhere(accelerator, state.unreadable_now) if guarded else []
    state.unreadable_now = []
    if bad and not cfg.skip_bad_samples:
        raise_unreadable(r, bad, "training", state.step + 1)
    if bad:
        state.unreadable_samples += [sample_name(r.job.data.train, i) for i in bad]
        state.bad_sample_steps += 1  # no update from a batch with stand-ins for unreadable samples
    elif cfg.skip_nonfinite and state.losses.last_step_nonfinite(accelerator):
        state.skipped_steps += 1  # no update from this step's gradients
    else:
        if _frozen_now(r):  # --freeze until --unfreeze-at: no update (the optimizer skips parameters without one)
            for p in r.tuning["frozen"]:
                p.grad = None
        if r.items:
            normalise_gradients(r)
        if cfg.max_grad_norm:
            accelerator.clip_grad_norm_(r.model.parameters(), cfg.max_grad_norm)
        r.optimizer.step()
        r.scheduler.step()
        if r.ema:
            r.ema.update_parameters(r.averaged)
        # fp16: the grad scaler skips a step whose gradients overflowed (no host sync: a flag)
        state.loss_scale_skipped_steps += accelerator.optimizer_step_was_skipped


def _frozen_now(r: Run) -> bool:
    return bool(r.tuning["frozen"]) and (r.cfg.unfreeze_at is None or r.epoch + 1 < r.cfg.unfreeze_at)


def normalise_gradients(r: Run) -> None:
    """For a loss summed over items (tokens, boxes): the gradient of the sum over the whole global batch
    divided by its number of items, whatever the processes and micro-batches it was split into.

    Each micro-batch's backward took sum / item_scale, Accelerate divided it by grad_accum, and DDP
    averaged over the processes; so the gradients are multiplied by item_scale x processes x grad_accum
    / (the items of every process's micro-batches of this step): one all-reduce of one number, and no
    host sync (the factor stays on the device)."""
    accelerator = r.accelerator
    items = r.state.losses.step_items().to(torch.float32)
    total = accelerator.reduce(items, "sum") if r.world > 1 else items
    factor = r.item_scale * r.world * r.cfg.grad_accum / total.clamp(min=1)
    grads = [p.grad for p in r.model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor.to(grads[0].device))


def log_interval(r: Run) -> None:
    """The loss over the interval on every process (a mean over micro-batches, or over every item), with speed."""
    cfg, state = r.cfg, r.state
    interval = state.losses.read(r.accelerator)
    if interval.bad is not None and not cfg.skip_nonfinite:
        raise TrainingStopped(_nonfinite_message(interval.bad, r.checkpoints.last), code=1)
    elapsed, steps, waited = r.clock.interval(state.step)
    record = {
        "step": state.step,
        "epoch": r.epoch + 1,
        "loss": interval.loss,
        **interval.parts,  # a model's named losses (loss_classifier, loss_box_reg, ...)
        "loss_per_rank": interval.per_rank,
        "lr": r.scheduler.get_last_lr()[0],
        "samples_per_s": steps * cfg.batch_size / elapsed,
        "step_time_s": elapsed / steps,
        "data_time_s": waited / steps,
        "flops_per_s": r.flops * steps * cfg.batch_size / elapsed,
    }
    r.files.log(record)
    if cfg.log_with:
        r.accelerator.log({"train/loss": record["loss"], **{f"train/{k}": v for k, v in interval.parts.items()},
                           "train/lr": record["lr"], "train/samples_per_s": record["samples_per_s"]}, step=state.step)
    r.progress.log(state.step, r.epoch, record["loss"], record["lr"], record["samples_per_s"])
    state.losses.restart(state.step)
    r.clock.restart()


def save_checkpoint(r: Run, name: str | None = None) -> None:
    """Everything needed to continue: `save_state`'s files and the run's state (all processes call this)."""
    bad = r.state.losses.read(r.accelerator).bad
    if bad is not None and not r.cfg.skip_nonfinite:  # never checkpoint weights a NaN/inf has reached
        raise TrainingStopped(_nonfinite_message(bad, r.checkpoints.last), code=1)
    saved = {**r.state.saved(r.accelerator), "world_size": r.world, "engine": r.engine,
             "parameters": r.parameters, "config": r.cfg.to_dict()}
    with r.checkpoints.writing(saved, name) as folder:
        r.accelerator.save_state(str(folder))


def stop_if_signalled(r: Run, signals: StopSignals, check: bool = True) -> None:
    """A SIGTERM/SIGINT on any process stops every process, after a checkpoint of this step."""
    stop = signals.agreed(check)  # the same answer on every process
    if not stop:
        return
    _checkpoint_this_step(r)
    raise TrainingStopped(
        f"stopped by {signal.Signals(stop).name} at step {r.state.step}; checkpoint saved in {r.checkpoints.last}; "
        f"continue with --resume auto --output-dir {r.out}", code=128 + stop)


def raise_unreadable(r: Run, indices: list[int], split: str, at: int) -> None:
    """A sample that cannot be read stops every process (they all agree on it), after a checkpoint."""
    r.optimizer.zero_grad()
    _checkpoint_this_step(r)
    dataset = r.job.data.train if split == "training" else r.job.data.eval
    more = f" (and {len(indices) - 1} more)" if len(indices) > 1 else ""
    raise TrainingStopped(f"{split} sample {sample_name(dataset, indices[0])}{more} cannot be read, at step {at}; "
                          f"checkpoint saved in {r.checkpoints.last}; acc-trainer check-data lists every such sample"
                          + ("; --skip-bad-samples skips them" if split == "training" else ""), code=1)


def _checkpoint_this_step(r: Run) -> None:
    if r.checkpoints.last is None or r.checkpoints.last.name != f"step-{r.state.step:08d}":
        save_checkpoint(r)


# ----------------------------------------------------------------------------------------- evaluate


def evaluate(accelerator: Accelerator, model, loader, loss_fn, metrics: dict, channels_last: bool = False,
             input_dtype: torch.dtype | None = None, guarded: bool = False, forward_fn: Callable | None = None,
             tables: dict | None = None) -> dict:
    """The loss and every metric over the whole evaluation set, each sample counted once whatever the
    number of processes, and nothing but running sums kept (never the whole set's outputs).

    Accelerate pads the last batch so that every process gets as many samples; `gather_for_metrics`
    drops that padding, so gathering each process's own index through it says how many of its samples
    are real. Only those are passed through the model (every process still makes one call, as FSDP
    needs), and each batch's loss and per-sample metrics are weighted by that count; a loss summed over
    items (tokens) is divided by the items of the whole set. A loss the outputs do not carry (a model
    that returns predictions in evaluation) is left out of the results. Metrics with state (F1, AUROC,
    mAP; metrics.py) are updated with the real samples only and computed once, over every process
    (`merged_metric`); `tables` (the confusion matrix) come back under "tables". With `guarded` batches
    (data.Guarded), the indices of samples that could not be read come back as `unreadable`.
    """
    model.eval()
    stateful = {name: m for name, m in {**metrics, **(tables or {})}.items() if is_stateful(m)}
    metrics = {name: m for name, m in metrics.items() if name not in stateful}
    builtin = {name: m for name, m in stateful.items() if isinstance(m, Stateful)}
    objects = {name: m for name, m in stateful.items() if name not in builtin}  # torchmetrics' and the like
    for metric in stateful.values():
        metric.reset()
        if hasattr(metric, "to") and metric in objects.values():  # a torchmetrics object: where the outputs are
            metric.to(accelerator.device)
    # loss total, loss count (items or samples), each metric's total, samples
    totals = torch.zeros(len(metrics) + 3, dtype=torch.float64, device=accelerator.device)
    unreadable, has_loss = [], True
    with torch.no_grad():
        for batch in loader:
            if isinstance(batch, Uncollated):  # a user's collate function (or a stream): collated once the real samples are known
                size = len(batch)
                real = batch.real if batch.real is not None else _real_samples(accelerator, size)
                batch = send_to_device(batch.first(max(real, 1)), accelerator.device, non_blocking=True)
                if guarded:
                    batch, indices = batch
            else:
                if guarded:
                    batch, indices = batch
                size = find_batch_size(batch)
                real = _real_samples(accelerator, size)
                if real < size:
                    batch = recursively_apply(lambda t: t[: max(real, 1)], batch)
            if guarded:
                unreadable += [i for i in indices[:real] if i >= 0]
            batch = model_inputs(batch, channels_last, input_dtype)
            outputs, targets, loss = batch_loss(model, batch, loss_fn, forward_fn)
            has_loss = has_loss and loss is not None  # the same on every process: each calls the model
            if objects:  # every process's real samples, to every process (a collective: before the skip below)
                shared = _everyones(accelerator, metric_input(outputs), targets, real)
                for metric in objects.values():
                    metric.update(*shared)
            if real == 0:
                continue
            loss_total = [totals.new_zeros(()), totals.new_zeros(())]
            if has_loss:
                loss_total = [loss.value.detach().double(), loss.items.double()] if loss.items is not None else [
                    _sample_sum(loss.value, real), totals.new_tensor(real)]
            values = [_sample_sum(metric(outputs, targets), real) for metric in metrics.values()]
            totals += torch.stack([*loss_total, *values, totals.new_tensor(real)])
            for metric in builtin.values():
                metric.update(outputs, targets)
    model.train()
    totals = accelerator.reduce(totals, "sum").tolist()
    count = int(totals[-1])
    results = {"loss": totals[0] / max(totals[1], 1)} if has_loss else {}
    results.update({name: total / count for name, total in zip(metrics, totals[2:-1])})
    for name, metric in stateful.items():
        value = merged_metric(accelerator, metric)
        if name in (tables or {}):
            results.setdefault("tables", {}).update(value)
        else:
            results.update(_as_numbers(name, value))
    results["samples"] = count
    if guarded:
        results["unreadable_indices"] = _unreadable_everywhere(accelerator, unreadable)
        results["unreadable"] = bool(results["unreadable_indices"])
    return results


def keep_evaluation(r: Run, results: dict) -> None:
    """Logs an evaluation, keeps it in the state, and checkpoints the best one (--save-best)."""
    cfg, state, epoch = r.cfg, r.state, r.epoch
    if results.pop("unreadable", False):  # an evaluation counts every sample: never skipped
        raise_unreadable(r, results["unreadable_indices"], "evaluation", state.step)
    results.pop("unreadable_indices", None)
    r.last_tables = results.pop("tables", {})
    state.evals.append({"step": state.step, "epoch": epoch + 1, **results})
    r.files.log({"step": state.step, "epoch": epoch + 1, **{f"eval_{k}": v for k, v in results.items()}})
    if cfg.log_with:
        r.accelerator.log({f"eval/{k}": v for k, v in results.items() if k != "samples"}, step=state.step)
    r.progress.print(f"epoch {epoch + 1}/{r.epochs or '?'}: " + _format_eval(results))
    for flag, name in (("--save-best", cfg.save_best), ("--early-stop", cfg.early_stop)):
        if name is not None and name not in results:
            raise ConfigError(f"{flag} {name}: the evaluation has no such result (it has {', '.join(results)})")
    if cfg.early_stop:  # decided first, so that a best checkpoint holds the decision too
        _early_stop(r, results[cfg.early_stop])
    if cfg.save_best and _improves(cfg.save_best, results, state.best):
        state.best = {"step": state.step, "metric": cfg.save_best, "value": results[cfg.save_best]}
        save_checkpoint(r, BEST)


def _early_stop(r: Run, value: float) -> None:
    """--early-stop: counts the evaluations since the metric last improved by more than --min-delta; at
    --patience the run stops, on every process at once (the results are the same everywhere, and the
    decision is all-reduced anyway). The counts are part of the state, so a resumed run stops where the
    uninterrupted one does."""
    cfg, state = r.cfg, r.state
    lower = LOWER_IS_BETTER.search(cfg.early_stop)
    if math.isnan(value):  # an undefined value (AUROC without one of the classes) is no improvement
        state.stale_evals += 1
    elif state.early_best is None or (value < state.early_best - cfg.min_delta if lower else
                                      value > state.early_best + cfg.min_delta):
        state.early_best, state.stale_evals = value, 0
    else:
        state.stale_evals += 1
    stop = state.stale_evals >= cfg.patience
    if r.world > 1:  # no process stops alone
        stop = bool(r.accelerator.reduce(torch.tensor(float(stop), device=r.accelerator.device), "sum").item())
    if stop:
        state.stopped_early = {"step": state.step, "epoch": r.epoch + 1, "metric": cfg.early_stop,
                               "best": state.early_best, "patience": cfg.patience,
                               "reason": f"{cfg.early_stop} did not improve by more than {cfg.min_delta} for "
                                         f"{cfg.patience} evaluations (best {state.early_best:.6g})"}
        r.progress.print(f"early stop at step {state.step}: {state.stopped_early['reason']}")


def _unreadable_everywhere(accelerator: Accelerator, local: list[int]) -> list[int]:
    """The indices of unreadable samples on any process, the same list on all (one tiny all-reduce;
    the indices themselves are gathered only when there are some)."""
    if accelerator.num_processes == 1:
        return sorted(set(local))
    if accelerator.reduce(torch.tensor(len(local), device=accelerator.device), "sum").item() == 0:
        return []
    return sorted({i for part in gather_object([local]) for i in part})


def merged_metric(accelerator: Accelerator, metric):
    """A metric with state, computed over every process: a built-in's counts summed (one all-reduce) and
    its per-sample rows gathered, exactly the real samples of each process; an object of another kind
    (torchmetrics') combines the processes itself in `compute`, which every process calls."""
    if not isinstance(metric, Stateful):
        # Every process updated it with every process's real samples (`_everyones`), so it must not gather them
        # again: torchmetrics' own synchronisation is turned off (its list states, mAP's, would need as many
        # updates on every process, which an exact evaluation cannot give: the last batch's real samples are
        # not spread evenly).
        if hasattr(metric, "sync_on_compute"):
            metric.sync_on_compute = metric._to_sync = False
        return metric.compute()
    several = accelerator.num_processes > 1
    sums = accelerator.reduce(metric.sums.to(accelerator.device), "sum").cpu() if several else metric.sums.cpu()
    rows = None
    if metric.width:
        local = torch.cat(metric.rows) if metric.rows else torch.zeros(0, metric.width, dtype=torch.float64)
        if several:  # padded to the longest share for the gather, then cut back to each share's length
            lengths = accelerator.gather(torch.tensor([len(local)], device=accelerator.device)).tolist()
            padded = accelerator.pad_across_processes(local.to(accelerator.device), dim=0)
            everything, size = accelerator.gather(padded).cpu(), padded.shape[0]
            local = torch.cat([everything[i * size: i * size + n] for i, n in enumerate(lengths)])
        rows = local.cpu()
    return metric.compute(sums, rows)


def _everyones(accelerator: Accelerator, predictions, targets, real: int) -> tuple:
    """This batch's real samples (predictions and targets) of every process, in process order, on every
    process: for metric objects, which then need no distributed code of their own."""
    mine = (_first(predictions, real), _first(targets, real))
    if accelerator.num_processes == 1:
        return mine
    parts = gather_object([send_to_device(mine, "cpu")])
    return tuple(send_to_device(_joined([part[i] for part in parts]), accelerator.device) for i in (0, 1))


def _first(values, n: int):
    if isinstance(values, torch.Tensor) and values.dim() or isinstance(values, (list, tuple)):
        return values[:n]
    if isinstance(values, Mapping):
        return {k: _first(v, n) for k, v in values.items()}
    return values


def _joined(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if isinstance(first, Mapping):
        return {k: _joined([p[k] for p in parts]) for k in first}
    return [item for part in parts for item in part]


def _as_numbers(name: str, value) -> dict:
    """A metric's result as named numbers: one number, or each number of a dict (torchmetrics' mAP gives map,
    map_50, ...: kept by their own names when they start with the metric's, else as name_key)."""
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point() or isinstance(v, float):
                out[key if key.startswith(name) else f"{name}_{key}"] = float(v)
        return out
    return {name: float(value)}


def _real_samples(accelerator: Accelerator, size: int) -> int:
    if not accelerator.gradient_state.end_of_dataloader:
        return size  # only the last batch is padded
    owner = torch.full((size,), accelerator.process_index, device=accelerator.device)
    return int((accelerator.gather_for_metrics(owner) == accelerator.process_index).sum())


def _sample_sum(value: torch.Tensor, samples: int) -> torch.Tensor:
    """A batch's total over its samples: a scalar is the batch's mean, a vector holds one value per sample."""
    value = value.detach().double()
    return value * samples if value.dim() == 0 else value.reshape(samples, -1).mean(dim=1).sum()


def model_inputs(batch, channels_last: bool, dtype: torch.dtype | None):
    """A batch as the model takes it: NHWC images for --channels-last, floating inputs in the weights'
    dtype under DeepSpeed. Targets (the pair's second item, a dict's labels) stay as they are; a batch of
    another shape (a user's forward function) is converted throughout."""
    if not channels_last and dtype is None:
        return batch

    def convert(t: torch.Tensor) -> torch.Tensor:
        if channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    if isinstance(batch, Mapping):
        return {k: v if k == "labels" else recursively_apply(convert, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        return [recursively_apply(convert, inputs), targets]
    return recursively_apply(convert, batch)


# ----------------------------------------------------------------------------------------- finish


def finish(r: Run) -> dict:
    """Checks every process ends with the same weights, saves them (`save_model`) and the summary, draws
    the plots."""
    accelerator = r.accelerator
    ranks_agree = processes.check_ranks_agree(accelerator, r.model, "final")
    accelerator.wait_for_everyone()
    # Accelerate saves a compiled model under its wrapper's names (`_orig_mod.fc1.weight`); saved from
    # the module itself, the weights load into the model as the user built it. FSDP and DeepSpeed need
    # their wrapper to gather the full weights.
    to_save = r.model if r.engine != "DDP" else accelerator.unwrap_model(r.model, keep_torch_compile=False)
    try:
        accelerator.save_model(r.ema.module if r.ema else to_save, r.out)
    except WRITE_ERRORS as e:
        if not accelerator.is_main_process:
            raise
        kept = f"the last complete checkpoint is {r.checkpoints.last}" if r.checkpoints.last else "no checkpoint was saved"
        raise TrainingStopped(f"writing the final weights {r.out / 'model.safetensors'} failed: "
                              f"{write_failure(e, r.out)}; {kept}", code=1, alone=True) from None
    summary = run_summary(r, ranks_agree)
    if r.cfg.model == "linreg" and accelerator.is_main_process:
        # From the full weights just saved: under FSDP a process's own parameters are only its shard.
        weights = load_file(r.out / "model.safetensors")
        summary["learned"] = {"weight": weights["linear.weight"].item(), "bias": weights["linear.bias"].item()}
        r.progress.print(f"learned weight {summary['learned']['weight']:.4f}, bias {summary['learned']['bias']:.4f}")
    r.files.write_summary(summary)
    plots = []
    if accelerator.is_main_process and r.cfg.plots:
        from .plots import plot_run  # matplotlib: 0.4 s to import, needed only here

        with r.files.writing(r.out / "plots"):
            plots = plot_run(r.out)
    final = r.state.evals[-1] if r.state.evals else None
    r.progress.print(f"[bold]final[/] {_format_eval(final) if final else 'no evaluation set'}; "
                     f"{summary['samples_per_s'] or 0:,.0f} samples/s; run files in {r.out}")
    r.progress.print(summary_table(summary, plots))
    accelerator.end_training()
    return summary


def _tables(r: Run) -> dict:
    """The last evaluation's confusion matrix (rows: targets, columns: predictions) and per-class table, by
    class name (the dataset's `classes`, else the class index)."""
    tables = r.last_tables or {}
    if "confusion_matrix" not in tables:
        return {}
    classes = list(getattr(r.job.data.train, "classes", None) or [])
    names = [str(c) for c in classes] if len(classes) == len(tables["per_class"]) else \
        [str(i) for i in range(len(tables["per_class"]))]
    return {"classes": names, "confusion_matrix": tables["confusion_matrix"],
            "per_class": dict(zip(names, tables["per_class"]))}


def run_summary(r: Run, ranks_agree: bool) -> dict:
    """What summary.json holds: the results, how the run was made, and how fast."""
    cfg, accelerator, state, clock = r.cfg, r.accelerator, r.state, r.clock
    final = state.evals[-1] if state.evals else None
    samples_per_s = (state.step - r.start_step) * cfg.batch_size / clock.train_time if clock.train_time else None
    peak = device_peak_flops(accelerator.device)
    flops_per_s = r.flops * samples_per_s if samples_per_s else None
    return {
        "model": r.job.model_name,
        "dataset": r.job.dataset_name,
        "loss_function": r.loss_name,
        "loss_per": r.loss_per,  # item: summed over items, divided by the global batch's count
        "unused_parameters": r.unused,
        "metrics": list(r.metrics),
        "augment": _describe_augment(r.augment, cfg),
        "weights": f"ema (decay {cfg.ema})" if r.ema else "trained",
        "world_size": r.world,
        "distributed_type": accelerator.distributed_type.value,
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "global_batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "per_process_batch_size": r.per_process_batch,
        "steps": state.step,
        "skipped_steps": state.skipped_steps,
        "bad_sample_steps": state.bad_sample_steps,
        "loss_scale_skipped_steps": state.loss_scale_skipped_steps,
        "unreadable_samples": state.unreadable_samples,
        "epochs": r.epochs or r.epoch + 1,
        "stream_resume": r.stream_resume,  # a resumed stream: how it reached its position, and in how long
        "train_samples": state.step * cfg.batch_size,
        "eval": {k: v for k, v in final.items() if k not in ("samples", "step", "epoch")} if final else None,
        "eval_samples": final["samples"] if final else 0,
        "evals": state.evals,
        "best": state.best,
        "stopped_early": state.stopped_early,
        "init": r.tuning["init"],
        "param_groups": [{"lr_mult": g.get("lr_mult", 1.0), "weight_decay": g.get("weight_decay"),
                          "parameters": len(g["params"])} for g in r.optimizer.param_groups],
        **_tables(r),
        "resumed_from": str(r.resume) if r.resume else None,
        "wall_time_s": time.perf_counter() - r.started,
        "train_time_s": clock.train_time,
        "data_time_share": clock.data_time / clock.train_time if clock.train_time else None,
        "samples_per_s": samples_per_s,
        "model_flops_per_sample": r.flops,
        "flops_per_s": flops_per_s,
        # against the bf16 peak of one device, as nanoGPT reports MFU
        "mfu": flops_per_s / (peak * r.world) if flops_per_s and peak else None,
        "peak_memory_mb": peak_memory_mb(accelerator.device),
        "ranks_agree": ranks_agree,
        "notes": r.notes,
        "output_dir": str(r.out),
        "versions": library_versions(),
    }


# ----------------------------------------------------------------------------------------- small helpers


def _cross_entropy_options(cfg: TrainConfig, checked: Checked, augment) -> Callable:
    """--label-smoothing, and the class probabilities of mixup and cutmix, are cross-entropy's."""
    if not (cfg.label_smoothing or (augment and augment.mixes)):
        return checked.loss
    if checked.fn is not cross_entropy:
        raise ConfigError(f"--label-smoothing, --mixup and --cutmix apply to the cross_entropy loss; this run uses "
                          f"{checked.loss_name}")
    return partial(cross_entropy, label_smoothing=cfg.label_smoothing) if cfg.label_smoothing else checked.loss


def _describe_augment(augment, cfg: TrainConfig) -> str:
    if augment is None:
        return "none"
    parts = [augment.kind] if augment.kind != "none" else []
    parts += [f"mixup {cfg.mixup}"] * bool(cfg.mixup) + [f"cutmix {cfg.cutmix}"] * bool(cfg.cutmix)
    return ", ".join(parts)


def _tracker(name: str | None) -> str | None:
    """Accelerate drops a tracker that is not installed with a warning; a user who asked for it gets an error."""
    if name is None:
        return None
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    if name not in LOGGER_TYPE_TO_CLASS:
        raise ConfigError(f"unknown tracker {name!r}; Accelerate supports {', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
    if name not in [str(t) for t in get_available_trackers()]:
        extra = ' (pip install -e ".[tensorboard]")' if name == "tensorboard" else ""
        raise ConfigError(f"--log-with {name}: the {name} package is not installed{extra}")
    return name


def _tracker_config(cfg: TrainConfig) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in cfg.to_dict().items()}


LOWER_IS_BETTER = re.compile(r"(^|_)(loss|error|mae|mse)$")


def _improves(metric: str, metrics: dict, best: dict | None) -> bool:
    if math.isnan(metrics[metric]):
        return False
    if best is None or math.isnan(best["value"]):
        return True
    lower = LOWER_IS_BETTER.search(metric)
    return metrics[metric] < best["value"] if lower else metrics[metric] > best["value"]


def _check_save_best(cfg: TrainConfig, checked: Checked, data) -> None:
    """--save-best and --early-stop name something the run evaluates (a metric object's results, such as
    torchmetrics' mAP dict, may be named by anything that starts with its name)."""
    evaluated = ["loss"] * checked.eval_loss + list(checked.metrics)
    objects = [name for name, m in checked.metrics.items() if is_stateful(m) and not isinstance(m, Stateful)]
    for flag, name in (("--save-best", cfg.save_best), ("--early-stop", cfg.early_stop)):
        if name is None:
            continue
        if data.eval is None:
            raise ConfigError(f"{flag} needs an evaluation set")
        if name not in evaluated and not any(name.startswith(o) for o in objects):
            raise ConfigError(f"{flag} {name}: the run evaluates {', '.join(evaluated) or 'nothing'}"
                              + ("" if checked.eval_loss else " (the model returns no loss in evaluation)"))


@contextmanager
def _naming_the_step(where):
    """An error from the user's code (model, loss, metric, dataset) keeps its traceback, with where it
    happened added: it is theirs to fix. The trainer's own errors pass through as they are."""
    try:
        yield
    except (ConfigError, TrainingStopped):
        raise
    except Exception as e:
        note = f"acc_trainer: raised in {where()}"
        if hasattr(e, "add_note"):
            e.add_note(note)
        else:  # Python 3.10
            print(note, file=sys.stderr)
        raise


def _nonfinite_message(step: int, last: Path | None) -> str:
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was saved before it"
    return f"the loss became NaN or inf at step {step}; stopped all processes ({kept}; --skip-nonfinite skips such steps)"


def _format_eval(metrics: dict) -> str:
    parts = [f"eval loss {metrics['loss']:.4f}"] if "loss" in metrics else ["eval"]
    parts += [format_metric(name, value) for name, value in metrics.items()
              if name not in ("loss", "samples", "step", "epoch")]
    return ", ".join(parts) + f" on {metrics['samples']} samples"
