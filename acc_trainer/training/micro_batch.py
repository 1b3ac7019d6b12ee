"""`--micro-batch N|auto`: the per-process micro-batch, the rest of the global batch made up by gradient accumulation.

The global batch (--batch-size) and so the math stay what they are: a micro-batch of m samples on each of W
processes accumulates batch_size / (W x m) times per optimizer step, and accumulation changes the final weights only
within rounding (the guarantee every topology keeps). `auto` finds the largest m that fits the device's memory: it
starts from the global batch's share of one process and, as Accelerate's `find_executable_batch_size` does, goes
down on an out-of-memory error (to the largest divisor of the share at most half the last size, so that the
accumulation is a whole number). Each size is tried with one forward and backward pass of the run's first samples
through the model as it will train (its starting weights, adapters, frozen parameters and gradient checkpointing in
place) on its device, under the run's autocast, with the optimizer's state stand-ins allocated beside it (Adam keeps
two tensors per parameter, SGD with momentum one): the memory of a training step. The try changes nothing of the
model (its gradients are dropped, its buffers put back) nor of the random numbers. Every process takes the size that
fits on all of them. A resumed run on as many processes keeps the checkpoint's choice without trying again.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import replace

import torch
from accelerate.utils import send_to_device
from accelerate.utils.memory import should_reduce_batch_size

from ..config import ConfigError, TrainConfig
from ..distributed import processes
from ..distributed.processes import Group
from ..workload import losses
from ..workload.components import Workload
from ..workload.first_batch import first_samples


def given(cfg: TrainConfig, group: Group, resumed: dict | None) -> tuple[TrainConfig, list[str]] | None:
    """`cfg` with --grad-accum set from --micro-batch N (or from `auto`'s choice a checkpoint kept), and what the
    start line says of it; None when `auto` must try sizes (`tried`, on the model as it will train)."""
    if cfg.micro_batch is None:
        return cfg, []
    world = group.state.num_processes
    share = cfg.batch_size // world
    if cfg.micro_batch != "auto":
        size = int(cfg.micro_batch)
        if share % size:
            raise ConfigError(f"--micro-batch {size} does not divide the {share} samples of --batch-size "
                              f"{cfg.batch_size} each of {world} process(es) takes per step")
        return replace(cfg, grad_accum=share // size), [_said(size, share, "as asked")]
    saved = (resumed or {}).get("config", {})
    if resumed and resumed["world_size"] == world and saved.get("micro_batch") == "auto":
        size = share // saved["grad_accum"]
        return replace(cfg, grad_accum=saved["grad_accum"]), [_said(size, share, "kept from the checkpoint")]
    if group.engine.shards:
        raise ConfigError(f"--micro-batch auto tries sizes on the whole model; under {group.engine.name} each process holds "
                          "a shard: give --micro-batch N (or --grad-accum)")
    return None


def tried(cfg: TrainConfig, job: Workload, model: torch.nn.Module, group: Group) -> tuple[TrainConfig, list[str]]:
    """`auto`: `cfg` with --grad-accum set by the largest micro-batch that fits, tried on `model` as it will train
    (its starting weights, adapters, frozen parameters and gradient checkpointing), and what the start line says."""
    share = cfg.batch_size // group.state.num_processes
    size, tries, held = largest_fitting(cfg, job, model, group, share)
    return replace(cfg, grad_accum=share // size), [_said(size, share, "the largest that fits: " + ", ".join(tries) +
                                                          "; tried on " + held)]


def _said(size: int, share: int, how: str) -> str:
    return (f"--micro-batch: {size} samples per process, accumulated {share // size} times to the {share} of each "
            f"process's share of the global batch ({how})")


def largest_fitting(cfg: TrainConfig, job: Workload, model: torch.nn.Module, group: Group,
                    share: int) -> tuple[int, list[str], str]:
    """The largest micro-batch (a divisor of `share`) whose training step of `model` fits on every process, what was
    tried, and what the tries held."""
    device = group.state.device
    home = next(model.parameters()).device
    model.to(device)  # where prepare will put it; back afterwards (the first-sample check runs where it was)
    try:
        return _largest(cfg, job, model, group, share, device)
    finally:
        model.to(home)


def _largest(cfg: TrainConfig, job: Workload, model, group: Group, share: int,
             device: torch.device) -> tuple[int, list[str], str]:
    size, tries = share, []
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    # transformers' switch, on each layer it checkpoints (its model-level name changed in transformers 5)
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    held = (f"{trainable:,} of {total:,} parameters with gradients and optimizer state, gradient checkpointing "
            + ("on" if checkpointing else "off"))
    while True:
        batch = send_to_device(first_samples(job.data.train, job.data.kind.train, size, job.collate, job.data.heads),
                               device)
        # The size that fits on every process; a process that fails otherwise stops every one.
        fits = all(processes.each_tries(lambda: _fits(cfg, job, model, batch, device)))
        tries.append(f"{size} {'fits' if fits else 'out of memory'}")
        if fits:
            return size, tries, held
        smaller = [d for d in range(size // 2, 0, -1) if share % d == 0]
        if not smaller:
            raise ConfigError(f"--micro-batch auto: not even 1 sample per process fits in the memory of {device} "
                              "(tried " + ", ".join(tries) + f"; {held})")
        size = smaller[0]


def _fits(cfg: TrainConfig, job: Workload, model: torch.nn.Module, batch, device: torch.device) -> bool:
    """Whether one training step of `batch` runs out of memory: forward, backward and the optimizer's state
    stand-ins (and DPO's reference copy's); the model, its gradients and buffers and the random numbers as they were."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    was_training, kept = model.training, []
    trainable = [p for p in model.parameters() if p.requires_grad]
    slots = {"sgd": 1 if cfg.momentum else 0, "adam": 2, "adamw": 2}.get(cfg.optimizer, 2)
    precision = cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            kept = [torch.zeros_like(p) for p in trainable for _ in range(slots)]
            if job.objective is not None and job.objective.copies_weights:  # a reference's frozen copy, to come
                kept += [torch.zeros_like(t) for t in [*model.parameters(), *model.buffers()]]
            model.train()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                outputs, _ = (job.forward or losses.forward)(model, batch)
            _scalar(outputs).backward()
        return True
    except Exception as error:
        if not (isinstance(error, torch.OutOfMemoryError) or should_reduce_batch_size(error)):
            raise  # the user's code or data: its own traceback
        return False
    finally:
        del kept
        for p in model.parameters():
            p.grad = None
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        model.train(was_training)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _scalar(outputs) -> torch.Tensor:
    """The model's own loss, else a sum over its floating outputs: something to take the backward pass of."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if loss is not None:
        return loss
    tensors = outputs if isinstance(outputs, (list, tuple)) else list(outputs.values()) \
        if isinstance(outputs, Mapping) else [outputs]
    return sum(t.float().mean() for t in tensors if torch.is_tensor(t) and t.is_floating_point())
