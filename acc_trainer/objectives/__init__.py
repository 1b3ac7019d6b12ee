"""What a run trains, as one piece that every part of the run asks: `of(cfg)` gives the run's objective, an object
with the same few answers whatever it is (`lm`, `dpo`, `grpo`, `reward`: one module each here):

- `shape(cfg, job)`: the data it takes and its collate, the forward and the loss with the figures they report, set on
  the workload; its options and the model checked (one line for what does not fit);
- `per_step(cfg)`: the configuration the loaders and the steps count in (GRPO's loader deals prompts, batch / G);
- `start(model, reload, autocast)`: what it needs once the starting weights are in place (a reference), the notes;
- `reference`: what the model is compared with (a dpo.Reference: the adapters off, or a frozen copy), or None;
- `copies_weights`: whether it keeps a second copy of the weights (what `--micro-batch auto` must hold);
- `iterations`: optimizer steps per batch the loader deals (GRPO's --num-iterations);
- `reads_ahead`: whether a step's micro-batches are read before its first trains (Accelerate must then not end an
  accumulation where the loader ends);
- `rollouts(r, batches)`: the micro-batches the loop trains on (GRPO's generated completions);
- `read_figures(accelerator)`: what each log step reports besides the loss, over every process;
- `card(cfg, loss)`: what the model card (README.md of a language model's run folder) says it trained for, and how.

Adding an objective is one module here with these answers, a line in `of`, and its tests (docs/layout.md).

May import: the base, data, workload, distributed, language.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

import torch

from ..config import ConfigError, TrainConfig
from ..workload.first_batch import OWN


class LM:
    """`--objective lm`: the loss of --loss (or the model's own) over the data as it is."""

    name = "lm"
    reference = None  # what the model is compared with (dpo.Reference), where the objective has one
    copies_weights = False
    reads_ahead = False
    iterations = 1

    def __init__(self, judge=None):
        self.judge, self.judging = judge, False  # fit()'s judge functions (else --judge's); attached once

    def per_step(self, cfg: TrainConfig) -> TrainConfig:
        return cfg

    def shape(self, cfg: TrainConfig, job) -> None:
        from . import dpo, judged

        kind = getattr(job.data.train, "kind", None)
        if kind == "prompt":
            raise ConfigError(f"{job.dataset_name} holds prompts without completions: they train with --objective grpo "
                              "(fit(..., objective='grpo', rewards=[...])), or give each a completion")
        if dpo.holds_pairs(job, look=False):
            raise ConfigError(f"{job.dataset_name} holds preference pairs (prompt, chosen, rejected): they train with "
                              "--objective dpo (fit(..., objective='dpo')), or a reward model with --objective reward")
        if cfg.dpo_beta != 0.1 or cfg.dpo_reference != "auto":
            raise ConfigError(f"--{'dpo-beta' if cfg.dpo_beta != 0.1 else 'dpo-reference'} applies with --objective dpo")
        if not self.judging and (self.judge or cfg.judge):
            judged.attach(cfg, job, self.judge)
            self.judging = True

    def start(self, model: torch.nn.Module, reload: Callable | None = None, autocast: Callable | None = None) -> list[str]:
        return []

    def rollouts(self, r, batches):
        return batches

    def read_figures(self, accelerator) -> dict:
        return {}

    def card(self, cfg: TrainConfig, loss: str) -> tuple[str, str]:
        return "language modelling", f"{loss if loss == OWN else f'`{loss}`'} loss"


GRPO_OPTIONS = ("rewards", "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "grpo_beta",
                "epsilon", "epsilon_high", "num_iterations", "scale_rewards", "loss_type", "mask_truncated_completions",
                "log_completions", "generation_groups")


def of(cfg: TrainConfig, rewards=None, judge=None):
    """The run's objective (`rewards`: fit()'s reward functions, for grpo; `judge`: fit()'s judge functions, for lm);
    an objective's options without it are one line."""
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    given = [n for n in GRPO_OPTIONS if getattr(cfg, n) != defaults[n]] + ["rewards"] * bool(rewards)
    if cfg.objective != "grpo" and given:
        raise ConfigError(f"--{given[0].replace('_', '-')} applies with --objective grpo")
    if cfg.objective != "reward" and cfg.center_rewards_coefficient is not None:
        raise ConfigError("--center-rewards-coefficient applies with --objective reward")
    if cfg.objective != "lm" and (cfg.judge or judge):
        raise ConfigError(f"--judge applies with --objective lm (--objective {cfg.objective} reports its own figures)")
    if cfg.objective == "dpo":
        from .dpo import DPO

        return DPO()
    if cfg.objective == "grpo":
        from .grpo import GRPO

        return GRPO(cfg, rewards)
    if cfg.objective == "reward":
        from .reward import RewardModel

        return RewardModel()
    return LM(judge)
