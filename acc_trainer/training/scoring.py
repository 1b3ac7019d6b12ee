"""How a run's batches are scored, settled before the Accelerator exists: the objective's pieces and the first-sample
check on a process's micro-batch (`first_samples`), tried again on the micro-batch `--micro-batch auto` finds (`sized`),
the checks at start that need the data (`checked_pieces`: the same data on every process, augmentation, --save-best),
the loss the run trains with (`training_loss`) and what the first samples showed that a user should know (`notes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from ..config import ConfigError, TrainConfig
from ..data import augment as augmentation
from ..distributed import engines, processes
from ..distributed.processes import Group
from ..workload.components import Workload
from ..workload.first_batch import Checked, check_fit
from ..workload.losses import cross_entropy, model_loss
from ..workload.metrics import Stateful, is_stateful
from . import micro_batch


@dataclass
class Scoring:
    """How batches are scored: the losses and metrics, and what the first samples showed of them."""

    loss_fn: Callable  # (outputs, targets) -> losses.Loss, one number or (sum, count)
    eval_loss_fn: Callable | None  # None: the evaluation outputs carry no loss (a detector's predictions)
    metrics: dict
    checked: Checked  # loss_name, items (a sum over items), loss_per, item_scale, unused parameters, tables


def first_samples(cfg: TrainConfig, job: Workload, group: Group, origin) -> tuple[TrainConfig, Checked, list[str] | None]:
    """The objective's pieces and the first-sample check on a process's micro-batch, once --micro-batch N has set the
    accumulation; with what the start line says of the micro-batch, None while `auto` has sizes to try (`sized`)."""
    job.objective.shape(cfg, job)  # its forward, loss, metrics and collate
    iterations, step = job.objective.iterations, (origin.resumed or {}).get("step", 0)
    if step % iterations:  # GRPO's generation trained on for several steps: resumed only at its first
        raise ConfigError(f"{origin.resume} is at step {step}, inside a generation trained on for --num-iterations "
                          f"{iterations} steps: resume from a checkpoint at a multiple of {iterations}")
    settled = micro_batch.given(cfg, group, origin.resumed)
    cfg, said = settled or (cfg, None)
    return cfg, on_micro_batch(cfg, job, group.engine, group.state.num_processes), said


def sized(cfg: TrainConfig, job: Workload, model, group: Group, accelerator: Accelerator, checked: Checked,
          said: list[str] | None) -> tuple[TrainConfig, Checked, list[str]]:
    """--micro-batch auto (`said` None): the largest size that fits, tried on `model` as it will train (its starting
    weights, adapters, frozen parameters, gradient checkpointing), the accumulation set, and the first samples checked
    again on that micro-batch (they were known to fit the model before: a misfit is one line, not an out-of-memory
    search)."""
    if said is not None:
        return cfg, checked, said
    cfg, said = micro_batch.tried(cfg, job, model, group)
    accelerator.gradient_accumulation_steps = cfg.grad_accum
    return cfg, on_micro_batch(cfg, job, group.engine, group.state.num_processes), said


def on_micro_batch(cfg: TrainConfig, job: Workload, engine: engines.Engine, world: int) -> Checked:
    """The first-sample check (first_batch.check_fit) on a process's micro-batch."""
    checked = check_fit(job, cfg.batch_size // (world * cfg.grad_accum))
    return _per_micro_batch(checked) if checked.items and engine.keeps_gradients else checked


def _per_micro_batch(checked: Checked) -> Checked:
    """Under DeepSpeed, which keeps the gradients to itself (they cannot be divided by the global batch's
    items): the model's own token loss stays a mean per micro-batch; a loss of (sum, count) is refused."""
    if checked.fn is not None:
        raise ConfigError(f"the loss {checked.loss_name} returns (sum, count), normalised over the global batch by scaling "
                          "the gradients, which DeepSpeed keeps to itself; use DDP or FSDP, or a mean loss")
    return replace(checked, loss=partial(model_loss, items=None), items=False, loss_per="position")


def checked_pieces(cfg: TrainConfig, job: Workload, accelerator: Accelerator, engine: engines.Engine, checked: Checked):
    """The checks at start that need the data, and the augmentation (None, or each sample's from --seed, the epoch
    and its index)."""
    set_seed(cfg.seed)  # dropout and every other random number of the run start from --seed
    data = job.data
    processes.check_same_data(accelerator, data)
    _check_save_best(cfg, checked, data)
    augment = augmentation.from_config(cfg, data)  # None, or each sample's from (seed, epoch, index)
    if job.collate and augment:
        raise ConfigError("--augment, --mixup and --cutmix work on batches of images (--augment auto: standard for "
                          "cifar10/cifar100); with --collate, give --augment none and augment in the dataset or the "
                          "collate function")
    if cfg.ema and engine.shards:
        raise ConfigError(f"--ema needs the whole model on every process; with {engine.name} each holds a shard")
    return augment


def scoring(cfg: TrainConfig, checked: Checked, augment) -> Scoring:
    """How batches are scored, from what the first samples of a micro-batch showed."""
    return Scoring(training_loss(cfg, checked, augment), training_loss(cfg, checked) if checked.eval_loss else None,
                   checked.metrics, checked)


def notes(checked: Checked, model, world: int, engine: engines.Engine) -> list[str]:
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
