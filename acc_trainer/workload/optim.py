"""Optimizers and learning-rate schedules by name. Schedules count optimizer steps."""

from __future__ import annotations

import math
import re

import torch

from ..config import ConfigError, TrainConfig


def build_optimizer(cfg: TrainConfig, params, lr: float, factory=None, fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer over `params` (a list of parameter groups, see param_groups): a built-in name, an
    import path to a class taking groups (with --optimizer-args), or `factory(groups)` from fit(). A built-in one
    runs, on a GPU, torch's foreach implementation (a few kernels over every parameter: torch's default there, asked
    for by name so that FSDP2's sharded parameters get it too) or with `fused` its fused one (one kernel; the same
    update up to rounding, which the caller asks for where the engine keeps plain parameters: DDP, one process); on a
    CPU torch's default, its loop over parameters (the same update as foreach, bit for bit, without foreach's
    grouping of the tensors by device and type at every step: 8 us of a small model's 150 us step)."""
    if factory is None and cfg.optimizer not in ("sgd", "adam", "adamw"):
        from .components import call_factory, import_object

        cls = import_object(cfg.optimizer, "--optimizer")
        factory = lambda groups: call_factory(cls, {"params": groups, "lr": lr, **(cfg.optimizer_args or {})}, {},
                                              f"--optimizer {cfg.optimizer}")
    if factory is not None:
        optimizer = factory(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    elif cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                                    weight_decay=cfg.weight_decay, **implementation(cfg, fused))
    elif cfg.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay, **implementation(cfg, fused))
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, **implementation(cfg, fused))
    for group in optimizer.param_groups:  # each group's share of the optimizer's own learning rate
        group["lr"] = group["lr"] * group.get("lr_mult", 1.0)
    return optimizer


def implementation(cfg: TrainConfig, fused: bool = False) -> dict:
    """The keyword that picks torch's implementation of a built-in optimizer for this run (build_optimizer)."""
    if fused:
        return {"fused": True}
    return {"foreach": True} if torch.cuda.is_available() and not cfg.cpu else {}


def param_groups(cfg: TrainConfig, model: torch.nn.Module, lr: float) -> list[dict]:
    """The model's parameters in groups of equal options, in the order the model lists them: each group's
    `lr_mult` (build_optimizer multiplies the optimizer's learning rate by it; the schedule then scales every
    group alike) and, where a rule sets one, its `weight_decay` (else the optimizer's own), from --param-groups
    (the first regular expression that matches a name), --no-decay-norm-bias and --layer-decay. Frozen
    parameters are in their groups too: every group exists from the first step (a resume finds the same)."""
    rules = [(re.compile(pattern), dict(options or {})) for pattern, options in (cfg.param_groups or {}).items()]
    for pattern, options in rules:
        unknown = set(options) - {"lr_mult", "weight_decay"}
        if unknown:
            raise ConfigError(f"--param-groups {pattern.pattern!r}: unknown option {sorted(unknown)[0]!r} (lr_mult, "
                              "weight_decay)")
    named = list(model.named_parameters())
    depth, deepest = _depths([name for name, _ in named]) if cfg.layer_decay else ({}, 0)
    groups: dict[tuple, dict] = {}
    for name, parameter in named:
        decay = 0.0 if cfg.no_decay_norm_bias and parameter.dim() <= 1 else None  # None: the optimizer's own
        rule = next((options for pattern, options in rules if pattern.search(name)), {})
        mult = float(rule.get("lr_mult", 1.0))
        decay = float(rule["weight_decay"]) if "weight_decay" in rule else decay
        if cfg.layer_decay:
            mult *= cfg.layer_decay ** (deepest - depth[name])
        group = groups.setdefault((mult, decay), {"params": [], "lr_mult": mult,
                                                  **({"weight_decay": decay} if decay is not None else {})})
        group["params"].append(parameter)
    return list(groups.values())


def _depths(names: list[str]) -> tuple[dict[str, int], int]:
    """Each parameter's depth for --layer-decay: the embedding or stem 0, the N-th block (ResNets' layerN,
    ViTs' blocks.N, ConvNeXts' stages.N) after it, in order, and the head and final norm last."""
    block = re.compile(r"(?:^|\.)(layer\d+|blocks\.\d+|stages\.\d+|layers\.\d+|h\.\d+|encoder\.layer\.\d+)\.")
    order: list[str] = []
    for name in names:
        found = block.search(name)
        if found and found.group(1) not in order:
            order.append(found.group(1))
    depth, seen_block = {}, False
    for name in names:
        found = block.search(name)
        if found:
            depth[name], seen_block = order.index(found.group(1)) + 1, True
        else:  # before the first block: the stem; after it: the head
            depth[name] = len(order) + 1 if seen_block else 0
    return depth, len(order) + 1


def build_scheduler(cfg: TrainConfig, optimizer, lr: float, total_steps: int, steps_per_epoch: int, factory=None):
    """constant, cosine (to 0) or step (x lr_gamma every lr_step_epochs), after a linear warmup; or one-cycle;
    or `factory(optimizer, total_steps)` (an import path, or from fit())."""
    if factory is None and cfg.scheduler not in ("constant", "cosine", "step", "onecycle"):
        from .components import import_object

        factory = import_object(cfg.scheduler, "--scheduler")
    if factory is not None:
        scheduler = factory(optimizer, total_steps)
        if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
            raise ConfigError(f"the scheduler factory returned {type(scheduler).__name__}, not a learning-rate scheduler")
        return scheduler
    warmup = cfg.warmup_steps if total_steps is None else min(cfg.warmup_steps, total_steps)  # None: a stream's
    if cfg.scheduler == "onecycle":
        # One-cycle has its own warmup; --warmup-steps sets its length (torch's default is 30 %).
        pct = warmup / total_steps if warmup else 0.3
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                                   total_steps=total_steps, pct_start=pct)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "cosine":
            progress = (step - warmup) / max(1, total_steps - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if cfg.scheduler == "step":
            return cfg.lr_gamma ** (step // (cfg.lr_step_epochs * steps_per_epoch))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
