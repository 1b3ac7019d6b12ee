"""Optimizers and learning-rate schedules by name. Schedules count optimizer steps."""

from __future__ import annotations

import math

import torch

from .config import TrainConfig


def build_optimizer(cfg: TrainConfig, params, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: TrainConfig, optimizer, lr: float, total_steps: int, steps_per_epoch: int):
    """constant, cosine (to 0) or step (x lr_gamma every lr_step_epochs), after a linear warmup; or one-cycle."""
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.scheduler == "onecycle":
        # One-cycle has its own warmup; --warmup-steps sets its length (torch's default is 30 %).
        pct = warmup / total_steps if warmup else 0.3
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps, pct_start=pct)

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
