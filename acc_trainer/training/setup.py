"""What a run builds before its first step, as a recipe (`setup`): each stage once, in the order a run needs them,
each a function of the part it concerns (docs/layout.md, "Setup, a recipe"). The run folder is written last, so that
a failed start leaves nothing behind. `setup` returns the `Run` the loop (loop.py) trains.

Accelerate calls made here: `Accelerator(...)` (`accelerator_for`, which `evaluate`/`predict` use too), `prepare` (the
model, the optimizer, the loaders and the scheduler: DDP, FSDP2 or DeepSpeed as the accelerate config selects, each
engine's room in distributed/engines/) and `register_for_checkpointing` for the EMA weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin, ProjectConfiguration, TorchDynamoPlugin

from .. import objectives, patches
from ..config import ConfigError, TrainConfig
from ..data.loaders import build_loaders, dataloader_config, placement
from ..distributed import engines, processes
from ..distributed.watchdog import Idle
from ..language import adapters
from ..outputs import run_folder, trackers
from ..workload import measure
from ..workload.components import Workload
from ..workload.models import compile_blocks, repeated_blocks
from . import scoring
from . import state as run_state
from .scoring import Scoring, training_loss  # noqa: F401 - training_loss: evaluate/predict's, as the run's
from .state import Clock, RunState, Shape, stream_position  # noqa: F401 - stream_position: the loop's

Group = processes.Group


@dataclass
class Trained:
    """What training changes, prepared: the model, its optimizer and schedule, the EMA of its weights."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    ema: Any  # torch.optim.swa_utils.AveragedModel of the trained weights, or None
    averaged: Any  # the module the EMA follows (the model without its wrappers)
    tuning: adapters.Tuning
    input_dtype: torch.dtype | None  # DeepSpeed's weights' dtype for floating inputs
    flops: int  # per training sample
    parameters: dict  # name -> shape, recorded in checkpoints
    counts: dict  # trainable and total parameters
    frozen: dict | None  # the frozen parameters' digest, when checkpoints hold only those that train (adapters.py)
    notes: list[str] = field(default_factory=list)  # what preparing said (FSDP2's units)


@dataclass
class Loaders:
    train: Any
    eval: Any
    augment: Any  # augment.Augment or None


@dataclass
class Run:
    """What `setup` builds for the loop: the prepared objects in a few parts, and the run's progress."""

    cfg: TrainConfig
    job: Workload
    accelerator: Accelerator
    engine: engines.Engine  # its room: distributed/engines/ (DDP, FSDP2, DeepSpeed)
    trained: Trained
    scoring: Scoring
    loaders: Loaders
    shape: Shape
    output: run_folder.Output
    state: RunState
    clock: Clock
    notes: list[str]
    started: float
    watch: Any = field(default_factory=lambda: Idle())  # the watchdog (watchdog.Watchdog) while the loop runs
    epoch: int = 0
    stream_resume: dict | None = None  # how a resumed stream reached its position (streams.StreamLoader.resumed)
    tables: dict = field(default_factory=dict)  # the last evaluation's tables: confusion_matrix, per_class
    given: TrainConfig | None = None  # the options as given (GRPO's batch in completions; `cfg`'s in prompts)

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def streaming(self) -> bool:  # the training set is a stream (streams.py), as settled where the data was built
        return self.job.data.kind.train.stream

    @property
    def per_process_batch(self) -> int:  # of one micro-batch
        return self.cfg.batch_size // (self.world * self.cfg.grad_accum)


def setup(cfg: TrainConfig, job: Workload, group: Group | None = None) -> Run:
    """The recipe of a run's start (docs/layout.md, "Setup, a recipe"); the folder is written only once all succeeded."""
    started = time.perf_counter()
    group = group or processes.start(cfg)
    given, cfg = cfg, _per_step(cfg, job)  # the workload's objective, and what its loaders deal a step
    processes.warn_if_one_process_was_meant(group.state)
    processes.check_topology(cfg, group.state)
    origin = run_folder.origin(cfg, job, group)  # where the run writes, and the checkpoint it continues
    cfg, checked, said = scoring.first_samples(cfg, job, group, origin)  # the pieces, checked on a micro-batch
    regional = cfg.compile and not group.engine.shards and bool(repeated_blocks(job.model))  # --compile by block
    accelerator = _accelerator(cfg, job, group, origin, checked, regional)
    augment = scoring.checked_pieces(cfg, job, accelerator, group.engine, checked)
    # The model as it will train: its starting weights (a 4-bit base, --init-from), its adapters, measured as built and
    # made the same on every process, then --sync-bn, channels last, --freeze and gradient checkpointing.
    model, tuning = adapters.starting_weights(cfg, job.model, origin.resumed, group.engine, job)
    tuning.shapes, tuning.flops = run_folder.fits(origin, model), measure.run_flops(job, model, accelerator)
    notes = processes.same_initial_weights(accelerator, model)  # before `prepare`, whose DDP would copy rank 0's silently
    model = adapters.as_it_trains(cfg, model, tuning, accelerator.device.type)
    notes += _reference(cfg, job, model, origin.resumed, accelerator)  # the objective's, of the starting weights
    notes += scoring.notes(checked, model, group.state.num_processes, group.engine) + measure.device_notes(accelerator)
    cfg, checked, said = scoring.sized(cfg, job, model, group, accelerator, checked, said)  # --micro-batch auto
    notes += said + tuning.notes + ([f"--compile: {compile_blocks(model)} repeated blocks compiled in place"] if regional else [])
    tuning.digest = adapters.frozen_checked(model, origin.resume, origin.resumed)
    trained, loaders, shape = _prepared(cfg, job, model, tuning, accelerator, group, origin.resumed, augment)
    state = run_state.started(cfg, accelerator, job, origin, trained, checked.items, shape, group.engine)
    shape.start_step = state.step
    notes += trained.notes + run_folder.start_notes(cfg, origin, group.state.num_processes, job.data.notes)
    job.data.heads.clear()  # the first samples read for the checks at start (up to a global batch) are not kept
    output = run_folder.opened(given, accelerator, origin, state.step, shape, job.unnamed)  # config.yaml, the trackers
    with run_folder.released_on_failure(output.files):
        r = Run(cfg, job, accelerator, group.engine, trained, scoring.scoring(cfg, checked, augment), loaders, shape,
                output, state, Clock(measure.StepGaps(accelerator.device), logged_step=state.step), notes, started,
                given=given)
        run_folder.announce(r)
    return r


def _per_step(cfg: TrainConfig, job: Workload) -> TrainConfig:
    """The run's objective (fit's, or --objective's), and the configuration its loaders deal a step in."""
    job.objective = job.objective or objectives.of(cfg)
    return job.objective.per_step(cfg)


def _accelerator(cfg: TrainConfig, job: Workload, group: Group, origin: run_folder.Origin, checked,
                 regional: bool) -> Accelerator:
    """The run's Accelerator, once the first samples showed how DDP wraps the model: DDP fails at the second step when
    a parameter gets no gradient, unless it looks for such parameters after every backward pass (a cost), asked for
    only when the first samples leave some unused."""
    ddp = [DistributedDataParallelKwargs(find_unused_parameters=True)] if checked.unused and group.state.num_processes > 1 else []
    return accelerator_for(cfg, group, origin.folder, ddp, not regional, job.objective.reads_ahead)


def _prepared(cfg: TrainConfig, job: Workload, model, tuning: adapters.Tuning, accelerator: Accelerator, group: Group,
              resumed: dict | None, augment) -> tuple:
    """(Trained, Loaders, Shape): the optimizer, its schedule and the run's shape, the loaders, `prepare` with what the
    engine needs before and after it, and the EMA of the prepared weights."""
    world = group.state.num_processes
    optimizer, scheduler, shape = run_state.schedule(cfg, model, job, resumed, group.engine)
    train_loader, eval_loader = build_loaders(cfg, job.data, world, accelerator.device, augment, job.collate,
                                              accelerator.process_index, processes.summing(accelerator), job.dataset_name)
    input_dtype, cut = group.engine.before_prepare(accelerator, model, cfg.batch_size // (world * cfg.grad_accum))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler,
        device_placement=group.engine.placement(placement(accelerator, train_loader, eval_loader)))
    tuning.frozen = group.engine.after_prepare(accelerator, model, tuning.frozen, tuning.frozen_names)
    ema, averaged = _ema(cfg, accelerator, model)
    trained = Trained(model, optimizer, scheduler, ema, averaged, tuning, input_dtype, tuning.flops, tuning.shapes,
                      adapters.parameter_counts(model, tuning.frozen if cfg.unfreeze_at else None), tuning.digest, cut)
    return trained, Loaders(train_loader, eval_loader, augment), shape


def accelerator_for(cfg: TrainConfig, group: Group, folder: Path | None = None, ddp: list | None = None,
                    compile_whole: bool = True, reads_ahead: bool = False) -> Accelerator:
    """The Accelerator of a run, or of `evaluate`/`predict` (no folder: no trackers, no compilation): the
    precision, the loaders' configuration, the process group's timeout, and the engine set up (its room in distributed/engines/).
    `reads_ahead`: a step's micro-batches are read before its first trains (GRPO's rollout), so an accumulation ends
    every grad_accum micro-batches, never where the loader says it has ended (the run's steps are whole anyway)."""
    training = folder is not None
    if torch.cuda.is_available() and training:  # TF32 tensor cores for float32 matmuls and convolutions (Ampere on)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    accelerator = Accelerator(
        cpu=group.cpu,
        mixed_precision=cfg.mixed_precision,  # None: the accelerate config's choice, else "no"
        dynamo_plugin=TorchDynamoPlugin(backend="inductor") if cfg.compile and compile_whole and training else None,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum if training else 1,
                                                                sync_with_dataloader=not reads_ahead),
        log_with=trackers.build(cfg, folder) or None if training else None,  # not started yet (trackers.start)
        project_config=ProjectConfiguration(project_dir=str(folder), logging_dir=str(folder / "logs"))
        if training else None,
        dataloader_config=dataloader_config(cfg),
        kwargs_handlers=[group.timeout, *(ddp or [])],
        **(group.engine.accelerator_kwargs(cfg) if training else {}),
    )
    (group.engine if training else engines.DDP()).set_up(accelerator)  # FSDP on CPU processes; no engine replaced
    patches.apply_to(accelerator)  # this accelerator's backward without a division by one
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "fp16":
        raise ConfigError("fp16 mixed precision needs a GPU; on a CPU use --mixed-precision bf16 or no")
    return accelerator


def _reference(cfg: TrainConfig, job: Workload, model, resumed: dict | None, accelerator: Accelerator) -> list[str]:
    """The objective's start (a reference) once the starting weights are the same on every process (a copy taken
    before would keep each process's own), under the run's autocast."""
    reload = cfg.init_from and resumed and not resumed.get("frozen")  # --init-from skipped above: the copy gets it
    return job.objective.start(model, partial(adapters.initial_weights, path=cfg.init_from,
                                              strict=cfg.init_strict) if reload else None, accelerator.autocast)


def _ema(cfg: TrainConfig, accelerator: Accelerator, model) -> tuple:
    """The exponential moving average of the weights: updated after every optimizer step, evaluated and
    saved in their place, and part of every checkpoint."""
    if not cfg.ema:
        return None, None
    averaged = accelerator.unwrap_model(model, keep_torch_compile=False)
    ema = torch.optim.swa_utils.AveragedModel(averaged, use_buffers=True,
                                              multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema))
    accelerator.register_for_checkpointing(ema)
    return ema, averaged
