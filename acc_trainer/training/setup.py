"""What a run builds before its first step: the processes, the Accelerator, the pieces checked on the first
samples, `prepare`, the state (from a checkpoint when resuming), and only then the run folder, so that a
failed start leaves nothing behind. `setup` returns the `Run` the loop (loop.py) trains.

Accelerate calls made here: `Accelerator(...)` (`accelerator_for`, which `evaluate`/`predict` use too),
`prepare` (the model, the optimizer, the loaders and the scheduler: DDP, FSDP or DeepSpeed as the
accelerate config selects, see distributed/engines/), `load_state` when resuming and `register_for_checkpointing` for
the EMA weights (the trackers, built here, start in trackers.py).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
    set_seed,
)

from .. import objectives, patches
from ..config import ConfigError, TrainConfig
from ..data import augment as augmentation
from ..data.datasets import steps_per_epoch
from ..data.loaders import build_loaders, dataloader_config, on_device
from ..distributed import engines, processes
from ..distributed.processes import Group
from ..distributed.watchdog import Idle
from ..language import adapters, pretrained
from ..outputs import checkpoints, trackers
from ..outputs.checkpoints import Checkpoints
from ..outputs.progress import Progress, engine_name
from ..outputs.runfiles import RunFiles, lock_run_folder, output_dir
from ..workload.components import Workload
from ..workload.first_batch import Checked, check_fit, first_samples
from ..workload.losses import cross_entropy, model_loss
from ..workload.measure import StepGaps, cpu_bf16_instructions, flops_per_sample
from ..workload.metrics import Stateful, is_stateful
from ..workload.models import compile_blocks, repeated_blocks, sync_batchnorm
from ..workload.optim import build_optimizer, build_scheduler, param_groups
from . import micro_batch
from .state import Clock, IntervalLosses, RunState


@dataclass
class Tuning:
    """--init-from's report and --freeze's parameters and norm layers (`_starting_weights`, adapters.freeze)."""

    init: dict | None = None
    frozen: list = field(default_factory=list)  # parameters frozen until --unfreeze-at (or for good)
    frozen_names: set = field(default_factory=set)  # their names, which `prepare` keeps (the engine's `after_prepare`)
    frozen_norms: list = field(default_factory=list)  # BatchNorm layers whose parameters are all frozen
    notes: list[str] = field(default_factory=list)


@dataclass
class Trained:
    """What training changes, prepared: the model, its optimizer and schedule, the EMA of its weights."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    ema: Any  # torch.optim.swa_utils.AveragedModel of the trained weights, or None
    averaged: Any  # the module the EMA follows (the model without its wrappers)
    tuning: Tuning
    input_dtype: torch.dtype | None  # DeepSpeed's weights' dtype for floating inputs
    flops: int  # per training sample
    parameters: dict  # name -> shape, recorded in checkpoints
    counts: dict  # trainable and total parameters
    frozen: dict | None  # the frozen parameters' digest, when checkpoints hold only those that train (adapters.py)


@dataclass
class Scoring:
    """How batches are scored: the losses and metrics, and what the first samples showed of them."""

    loss_fn: Callable  # (outputs, targets) -> losses.Loss, one number or (sum, count)
    eval_loss_fn: Callable | None  # None: the evaluation outputs carry no loss (a detector's predictions)
    metrics: dict
    checked: Checked  # loss_name, items (a sum over items), loss_per, item_scale, unused parameters, tables


@dataclass
class Loaders:
    train: Any
    eval: Any
    augment: Any  # augment.Augment or None


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


@dataclass
class Output:
    """Where the run writes: its folder, its files and checkpoints, and what the terminal shows."""

    folder: Path
    resume: Path | None  # the checkpoint the run continues from
    files: RunFiles
    checkpoints: Checkpoints
    progress: Progress


@dataclass
class Run:
    """What `setup` builds for the loop: the prepared objects in a few parts, and the run's progress."""

    cfg: TrainConfig
    job: Workload
    accelerator: Accelerator
    engine: str  # DDP, FSDP or DEEPSPEED
    trained: Trained
    scoring: Scoring
    loaders: Loaders
    shape: Shape
    output: Output
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


@dataclass
class _Origin:
    """Where a run writes and what it continues from."""

    folder: Path
    resume: Path | None
    resumed: dict | None  # the checkpoint's trainer state (checkpoints.read_state)
    notes: list[str]  # checkpoints --resume auto skipped, and why


def setup(cfg: TrainConfig, job: Workload, group: Group | None = None) -> Run:
    """Processes, the Accelerator, the pieces checked on one sample, `prepare`, the state (from a
    checkpoint when resuming), and only then the run folder: a failed start leaves nothing behind."""
    started = time.perf_counter()
    group = group or processes.start(cfg)
    given, cfg = cfg, _per_step(cfg, job)
    processes.warn_if_one_process_was_meant(group.state)
    processes.check_topology(cfg, group.state)
    world = group.state.num_processes
    origin = _origin(cfg, job, group)
    # Before the Accelerator: how DDP wraps the model depends on what the first samples show.
    cfg, checked, said = _shaped(cfg, job, group, origin)
    # DDP fails at the second step when a parameter gets no gradient, unless it looks for such parameters
    # after every backward pass (a cost): asked for only when the first samples leave some unused.
    ddp = [DistributedDataParallelKwargs(find_unused_parameters=True)] if checked.unused and world > 1 else []
    regional = cfg.compile and not group.engine.shards and bool(repeated_blocks(job.model))
    accelerator = accelerator_for(cfg, group, origin.folder, ddp, not regional, job.objective.reads_ahead)
    model, augment = _pieces(cfg, job, accelerator, group.engine, checked)
    if cfg.gradient_checkpointing:
        pretrained.gradient_checkpointing(model)
    model, tuning = _starting_weights(cfg, model, origin.resumed, group.engine, job)  # --init-from, then --lora
    if origin.resumed:
        checkpoints.check_model(origin.resume, origin.resumed, model)
    shapes = checkpoints.parameter_shapes(model)  # as the user built it: what a checkpoint must match
    flops = _flops(job, model, accelerator)  # before BatchNorm layers become collective (--sync-bn)
    # Compared (and made equal, with a note) before `prepare`, whose DDP wrapper would silently copy
    # rank 0's weights over a seeding mistake.
    notes = processes.same_initial_weights(accelerator, model) + _reference(cfg, job, model, origin.resumed, accelerator)
    notes += _notes(checked, model, world, group.engine) + _device_notes(accelerator)
    if cfg.sync_bn:
        model = sync_batchnorm(model, accelerator.device.type)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    adapters.freeze(cfg, model, tuning)  # before the groups and prepare
    cfg, checked, said = _sized(cfg, job, model, group, accelerator, checked, said)  # --micro-batch auto: tried now
    scoring = _scoring(cfg, checked, augment)
    notes += said + tuning.notes + ([f"--compile: {compile_blocks(model)} repeated blocks compiled in place"] if regional else [])
    frozen = _frozen_digest(model, origin)
    optimizer, scheduler, shape = _optimizer(cfg, model, job, origin.resumed, group.engine)
    train_loader, eval_loader = build_loaders(cfg, job.data, world, accelerator.device, augment, job.collate,
                                              accelerator.process_index, processes.summing(accelerator), job.dataset_name)
    input_dtype, cut = group.engine.before_prepare(accelerator, model, cfg.batch_size // (world * cfg.grad_accum))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler,
        device_placement=group.engine.placement(_placement(accelerator, train_loader, eval_loader)))
    tuning.frozen = group.engine.after_prepare(accelerator, model, tuning.frozen, tuning.frozen_names, bool(frozen))
    ema, averaged = _ema(cfg, accelerator, model)
    trained = Trained(model, optimizer, scheduler, ema, averaged, tuning, input_dtype, flops, shapes,
                      adapters.parameter_counts(model, tuning.frozen if cfg.unfreeze_at else None), frozen)
    state = _state(cfg, accelerator, job, origin, trained, checked, shape, group.engine)
    shape.start_step = state.step
    notes += cut + _start_notes(cfg, origin, world, job.data.notes)
    job.data.heads.clear()  # the first samples read for the checks at start (up to a global batch) are not kept
    output = _output(given, accelerator, origin, state, shape, job.unnamed)  # config.yaml: the options as given
    with _released_on_failure(output.files):
        r = Run(cfg, job, accelerator, group.engine, trained, scoring, Loaders(train_loader, eval_loader, augment), shape,
                output, state, Clock(StepGaps(accelerator.device), logged_step=state.step), notes, started, given=given)
        _announce(r)
    return r


def _frozen_digest(model, origin: _Origin) -> dict | None:
    """The digest of the frozen weights (checkpoints keep the trainable ones), checked against a resumed run's."""
    frozen = adapters.frozen_digest(model)
    if origin.resumed and origin.resumed.get("frozen"):
        adapters.check_frozen(origin.resume, origin.resumed["frozen"], model)
    return frozen


def _per_step(cfg: TrainConfig, job: Workload) -> TrainConfig:
    """The run's objective (fit's, or --objective's), and the configuration its loaders deal a step in."""
    job.objective = job.objective or objectives.of(cfg)
    return job.objective.per_step(cfg)


def _shaped(cfg: TrainConfig, job: Workload, group: Group, origin: _Origin) -> tuple[TrainConfig, Checked, list[str] | None]:
    """The objective's pieces and the first-sample check on a process's micro-batch, once --micro-batch N has set the
    accumulation; with what the start line says of the micro-batch, None while `auto` has sizes to try (`_sized`)."""
    job.objective.shape(cfg, job)  # its forward, loss, metrics and collate
    iterations, step = job.objective.iterations, (origin.resumed or {}).get("step", 0)
    if step % iterations:  # GRPO's generation trained on for several steps: resumed only at its first
        raise ConfigError(f"{origin.resume} is at step {step}, inside a generation trained on for --num-iterations "
                          f"{iterations} steps: resume from a checkpoint at a multiple of {iterations}")
    settled = micro_batch.given(cfg, group, origin.resumed)
    cfg, said = settled or (cfg, None)
    return cfg, _checked(cfg, job, group.engine, group.state.num_processes), said


def _sized(cfg: TrainConfig, job: Workload, model, group: Group, accelerator: Accelerator, checked: Checked,
           said: list[str] | None) -> tuple[TrainConfig, Checked, list[str]]:
    """--micro-batch auto (`said` None): the largest size that fits, tried on `model` as it will train (its starting
    weights, adapters, frozen parameters, gradient checkpointing), the accumulation set, and the first samples checked
    again on that micro-batch (they were known to fit the model before: a misfit is one line, not an out-of-memory
    search)."""
    if said is not None:
        return cfg, checked, said
    cfg, said = micro_batch.tried(cfg, job, model, group)
    accelerator.gradient_accumulation_steps = cfg.grad_accum
    return cfg, _checked(cfg, job, group.engine, group.state.num_processes), said


def _checked(cfg: TrainConfig, job: Workload, engine: engines.Engine, world: int) -> Checked:
    """The first-sample check (first_batch.check_fit) on a process's micro-batch."""
    checked = check_fit(job, cfg.batch_size // (world * cfg.grad_accum))
    return _per_micro_batch(checked) if checked.items and engine.keeps_gradients else checked


def _flops(job: Workload, model, accelerator: Accelerator) -> float:
    """FLOPs per training sample, counted on one sample by the main process only (0 on the others)."""
    if not accelerator.is_main_process:
        return 0
    return flops_per_sample(model, first_samples(job.data.train, job.data.kind.train, 1, job.collate, job.data.heads),
                            job.forward)


def _device_notes(accelerator: Accelerator) -> list[str]:
    """A patch left off on a version it was not tested on; bf16 emulated on a CPU without bf16 instructions."""
    notes = patches.notes()
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16" and cpu_bf16_instructions() is False:
        notes.append("note: this CPU has no bf16 instructions (AVX512-BF16, AMX or Arm's BF16): bf16 is emulated and "
                     "runs several times slower than --mixed-precision no (docs/language-models.md#precision-on-a-cpu)")
    return notes


def _state(cfg: TrainConfig, accelerator: Accelerator, job: Workload, origin: _Origin, trained: Trained,
           checked: Checked, shape: Shape, engine_: engines.Engine) -> RunState:
    """The run's progress: new, or the checkpoint's (its weights, optimizer, scheduler, random states and state
    loaded into the prepared objects; from another engine's checkpoint through its room, distributed/engines/)."""
    state = RunState(IntervalLosses(cfg.grad_accum, accelerator.device, checked.items))
    if job.data.kind.train.stream:
        state.stream = stream_position(0, 0, shape.per_epoch)
    if origin.resumed:
        partial = bool(origin.resumed.get("frozen"))  # the frozen weights are not in it: built again above
        saved_world, saved, engine = origin.resumed["world_size"], engines.of(origin.resumed["engine"]), engine_
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


def _start_notes(cfg: TrainConfig, origin: _Origin, world: int, data_notes: list[str]) -> list[str]:
    """What the start line says of where the run starts (another number of processes than the checkpoint's, what
    finding the checkpoint noted, no checkpoint yet for --resume auto) and of the data's labels."""
    notes = checkpoints.elastic_note(origin.resumed["world_size"], world) if origin.resumed else []
    notes += origin.notes + data_notes
    if cfg.resume == "auto" and not origin.resume:
        notes.append(f"--resume auto: no checkpoint in {origin.folder / 'checkpoints'} yet: the run starts from its "
                     "beginning")
    return notes


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


def _origin(cfg: TrainConfig, job: Workload, group: Group) -> _Origin:
    """The run's folder and the checkpoint it resumes from (checked against this run)."""
    folder = output_dir(cfg, job.model_name, job.dataset_name)
    resume, notes = checkpoints.find_resume(cfg, folder)
    resumed = checkpoints.read_state(resume, cfg, group.state.num_processes, group.engine) if resume else None
    return _Origin(folder, resume, resumed, notes)


def _placement(accelerator: Accelerator, train_loader, eval_loader) -> list:
    """Batches of tensors already on the training device need no copy: Accelerate's send_to_device would
    still walk every batch (12 us of a 90 us step of a small model here). DeepSpeed refuses the list (its room says
    so); FSDP2 and tensor parallelism ignore it."""
    return [None, None, *(False if on_device(loader, accelerator.device) else None
                          for loader in (train_loader, eval_loader)), None]


def _output(cfg: TrainConfig, accelerator: Accelerator, origin: _Origin, state: RunState, shape: Shape,
            unnamed: tuple[str, ...] = ()) -> Output:
    """Startup succeeded: only now does the run write anything (the folder locked, its config, the trackers)."""
    # --resume auto with no checkpoint yet: an earlier attempt's files (stopped before its first checkpoint) are
    # replaced, from step 0 on.
    again = cfg.resume == "auto"
    existed = origin.folder.exists()
    lock = []  # the folder's lock, held by the main process until the run ends (RunFiles.release)
    processes.main_decides(lambda: lock.append(lock_run_folder(origin.folder, origin.resume is not None or again)))
    try:
        if cfg.log_with:  # before the run's own files: a tracker that fails to start leaves the folder reusable
            processes.main_decides(lambda: trackers.start(accelerator, cfg, origin.folder, existed))
        files = RunFiles(origin.folder, enabled=accelerator.is_main_process,
                         resumed_step=state.step if origin.resumed or again else None, lock=lock[0] if lock else None)
    except BaseException:
        for handle in lock:
            handle.close()
        raise
    with _released_on_failure(files):
        files.write_config(cfg, unnamed)
        saver = Checkpoints(accelerator, origin.folder / "checkpoints", cfg.keep_last)
        saver.last = origin.resume
        progress = Progress(cfg.progress, accelerator.is_main_process, shape.total_steps, shape.epochs, shape.per_epoch)
    return Output(origin.folder, origin.resume, files, saver, progress)


@contextmanager
def _released_on_failure(files: RunFiles):
    """A start that fails once the folder is locked lets the lock go (the run's own `finally` is not reached yet)."""
    try:
        yield
    except BaseException:
        files.release()
        raise


def stream_position(epoch: int, start: int, epoch_steps: int | None) -> dict:
    """A stream's position at the start of `epoch` (which begins after optimizer step `start`), as checkpoints
    keep it; the loader moves `samples` and `state` on as it hands out each step (streams.StreamLoader.epoch)."""
    return {"epoch": epoch, "start": start, "samples": 0, "state": None, "epoch_steps": epoch_steps}


def _per_micro_batch(checked: Checked) -> Checked:
    """Under DeepSpeed, which keeps the gradients to itself (they cannot be divided by the global batch's
    items): the model's own token loss stays a mean per micro-batch; a loss of (sum, count) is refused."""
    if checked.fn is not None:
        raise ConfigError(f"the loss {checked.loss_name} returns (sum, count), normalised over the global batch by scaling "
                          "the gradients, which DeepSpeed keeps to itself; use DDP or FSDP, or a mean loss")
    return replace(checked, loss=partial(model_loss, items=None), items=False, loss_per="position")


def _pieces(cfg: TrainConfig, job: Workload, accelerator: Accelerator, engine: str, checked: Checked) -> tuple:
    """The model as the user built it and the augmentation (checked on the first samples)."""
    set_seed(cfg.seed)  # dropout and every other random number of the run start from --seed
    model, data = job.model, job.data
    processes.check_same_data(accelerator, data)
    _check_save_best(cfg, checked, data)
    augment = augmentation.from_config(cfg, data)  # None, or each sample's from (seed, epoch, index)
    if job.collate and augment:
        raise ConfigError("--augment, --mixup and --cutmix work on batches of images (--augment auto: standard for "
                          "cifar10/cifar100); with --collate, give --augment none and augment in the dataset or the "
                          "collate function")
    if cfg.ema and engine.shards:
        raise ConfigError(f"--ema needs the whole model on every process; with {engine.name} each holds a shard")
    return model, augment


def _scoring(cfg: TrainConfig, checked: Checked, augment) -> Scoring:
    """How batches are scored, from what the first samples of a micro-batch showed."""
    return Scoring(training_loss(cfg, checked, augment), training_loss(cfg, checked) if checked.eval_loss else None,
                   checked.metrics, checked)


def _notes(checked: Checked, model, world: int, engine: str) -> list[str]:
    """What the first samples showed that a user should know: unused parameters, a loss that weighs
    micro-batches unequally, dropout on several processes."""
    notes = []
    if checked.unused:
        shown = ", ".join(checked.unused[:5]) + (f" and {len(checked.unused) - 5} more" if len(checked.unused) > 5 else "")
        notes.append(f"the forward never uses {shown} (no gradient from the first samples)" +
                     ("; DDP looks for unused parameters after every backward pass (find_unused_parameters)"
                      if world > 1 and not engine.shards else ""))
    if checked.loss_per == "position":
        notes.append(f"the loss {checked.loss_name} is a mean over each micro-batch's positions (tokens, pixels): where "
                     "their number varies (padding, labels of -100), micro-batches weigh unequally and training depends "
                     "on the number of processes and --grad-accum; return (sum, count) to count every position once")
    if world > 1 and any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        notes.append("the model has dropout: each process draws its own masks, so another number of processes trains on "
                     "the same samples with the same expected gradient, not the same masks")
    return notes


def _optimizer(cfg: TrainConfig, model, job: Workload, resumed: dict | None = None, engine: str = "DDP") -> tuple:
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


def _starting_weights(cfg: TrainConfig, model, resumed: dict | None, engine: str, job: Workload) -> tuple:
    """(the model, its Tuning): --init-from's weights (not when resuming from a checkpoint that holds them all),
    then --lora's adapters around them (adapters.py)."""
    out = Tuning()
    model = adapters.base_in_4bit(cfg, model, job, engine, out)  # a 4-bit base holds --init-from's weights already
    if out.init is None and cfg.init_from and (not resumed or resumed.get("frozen")):
        report = checkpoints.initial_weights(model, cfg.init_from, cfg.init_strict)
        out.init = report
        out.notes.append(f"init from {cfg.init_from}: {report['loaded']} tensors loaded" + "".join(
            f", {len(report[k])} {k} ({', '.join(report[k][:3])}{', ...' if len(report[k]) > 3 else ''})"
            for k in ("reset", "missing", "unexpected") if report[k]))
    if cfg.lora:
        adapters.check_merge_sharded(cfg, model, engine)
        model = adapters.apply_lora(cfg, model)
        counts = adapters.parameter_counts(model)
        out.notes.append(f"LoRA rank {cfg.lora} on {cfg.lora_targets and ','.join(cfg.lora_targets) or 'every linear layer'}"
                         f": {counts['trainable']:,} of {counts['total']:,} parameters train "
                         f"({100 * counts['trainable'] / counts['total']:.2f}%)")
    return model, out


def _reference(cfg: TrainConfig, job: Workload, model, resumed: dict | None, accelerator: Accelerator) -> list[str]:
    """The objective's start (a reference) once the starting weights are the same on every process (a copy taken
    before would keep each process's own), under the run's autocast."""
    reload = cfg.init_from and resumed and not resumed.get("frozen")  # --init-from skipped above: the copy gets it
    return job.objective.start(model, partial(checkpoints.initial_weights, path=cfg.init_from,
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


def _announce(r: Run) -> None:
    accelerator, cfg = r.accelerator, r.cfg
    r.output.progress.print(
        f"[bold]acc_trainer[/] {r.job.model_name} on {r.job.dataset_name}: {r.world} process(es) "
        f"({engine_name(accelerator.distributed_type.value)}, {accelerator.device.type}), precision "
        f"{accelerator.mixed_precision}, "
        f"global batch {cfg.batch_size} = {r.world} x {cfg.grad_accum} x {r.per_process_batch}, "
        + (f"{r.shape.total_steps} steps" if r.shape.total_steps else
           "steps: as many as the stream gives (learnt in its first epoch)")
        + (f", resuming at step {r.state.step} from {r.output.resume}" if r.output.resume else "")
        + f"; {_counted(r.trained.counts)}"
    )
    for note in r.notes:
        r.output.progress.print(note)


def _counted(counts: dict) -> str:
    if counts["trainable"] == counts["total"]:
        return f"{counts['total']:,} parameters, all trained"
    return f"{counts['trainable']:,} of {counts['total']:,} parameters trained"


def training_loss(cfg: TrainConfig, checked: Checked, augment=None) -> Callable:
    """The loss the run trains with: --label-smoothing, and the class probabilities of mixup and cutmix (with
    `augment`), are cross-entropy's. Evaluation (the run's, and `evaluate` on it) uses it without `augment`."""
    if not (cfg.label_smoothing or (augment and augment.mixes)):
        return checked.loss
    if checked.fn is not cross_entropy:
        raise ConfigError(f"--label-smoothing, --mixup and --cutmix apply to the cross_entropy loss; this run uses "
                          f"{checked.loss_name}")
    return partial(cross_entropy, label_smoothing=cfg.label_smoothing) if cfg.label_smoothing else checked.loss


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
