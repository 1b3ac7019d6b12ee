"""Reward models trained on preference pairs (`--objective reward`): a sequence classifier with one output
(`AutoModelForSequenceClassification` with `num_labels=1`) scores prompt + chosen and prompt + rejected, and learns to
score the chosen one higher, with the Bradley-Terry loss as TRL 1.16's RewardTrainer computes it (`compute_loss`).

The data is DPO's: pairs of text or chat messages, tokenized by text.Tokenized ("preference") and batched as B pairs
in 2B rows (the chosen rows, then the rejected ones: text.preference_collate, each row prompt + completion, as TRL's
DataCollatorForPreference builds them). The score of a row is the model's output at its last token that is not padding
(transformers' sequence classifiers pool there: `config.pad_token_id` is set to the run's padding token, as TRL sets
it). A pair's loss is `-log sigmoid(chosen - rejected - margin)` (`margin`: the pair's own, when its samples hold one),
plus `--center-rewards-coefficient` x (chosen + rejected)^2 when given; the loss returns (sum over the pairs, pairs),
so the loop divides by the pairs of the whole global batch: TRL's means, exact over processes and accumulation. What
users read, per pair: `accuracy` (the chosen score the higher) and `margin` (chosen - rejected), at each log step and
at every evaluation (each pair counted once).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError, TrainConfig
from ..data.mixtures import Mixture
from ..data.text import Tokenized, pad_id, preference_collate
from ..data.text_streams import TokenizedStream
from ..distributed import engines
from ..workload.components import Workload
from ..workload.losses import Loss
from .dpo import holds_pairs, own_forward_and_loss, unwrapped

FIGURES = ("accuracy", "margin")


def reward_collate(pad: int, max_length: int | None = None) -> Callable:
    """Pairs as TRL's DataCollatorForPreference batches them for a reward model: `input_ids` [2B, T] (prompt + chosen
    rows, then prompt + rejected rows, right padded with `pad`), `attention_mask`, and `margin` [B] (float32) when a
    sample of the batch holds one (a sample without one: 0, the same loss as no margin)."""
    rows = preference_collate(pad, max_length)

    def collate(samples: list) -> dict[str, torch.Tensor]:
        batch = rows(samples)
        del batch["completion_mask"]  # the whole sequence is scored, not its completion's tokens
        if any("margin" in s for s in samples):
            batch["margin"] = torch.tensor([float(s.get("margin", 0.0)) for s in samples], dtype=torch.float)
        return batch

    return collate


@functools.lru_cache(maxsize=None)
def _takes_use_cache(cls: type) -> bool:
    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def scores(model, batch: Mapping) -> torch.Tensor:
    """The model's one output for each row of `batch` ([rows], float32); no cache built (TRL: use_cache=False)."""
    inner = unwrapped(model)
    keeps = getattr(getattr(inner, "config", None), "use_cache", False) is True
    extra = {"use_cache": False} if keeps and _takes_use_cache(type(inner)) else {}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra)
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    return logits.squeeze(-1).float()


def reward_forward(model, batch: Mapping):
    """forward(model, batch) -> ({rewards_chosen, rewards_rejected} [B] each, the pairs' margins [B] or None)."""
    chosen, rejected = scores(model, batch).chunk(2)
    return {"rewards_chosen": chosen, "rewards_rejected": rejected}, batch.get("margin")


def reward_loss(center_rewards_coefficient: float | None = None) -> Callable:
    """loss(outputs, margin) -> Loss(sum over the pairs of -log sigmoid(chosen - rejected - margin) [+ coefficient x
    (chosen + rejected)^2], the number of pairs, the figures summed over the pairs): over the global batch's pairs,
    TRL's RewardTrainer.compute_loss (its mean, and its mean of the centring term)."""

    def loss(outputs, margin) -> Loss:
        chosen, rejected = outputs["rewards_chosen"], outputs["rewards_rejected"]
        difference = chosen - rejected if margin is None else chosen - rejected - margin.to(chosen.dtype)
        per_pair = -F.logsigmoid(difference)
        if center_rewards_coefficient is not None:
            per_pair = per_pair + center_rewards_coefficient * (chosen + rejected) ** 2
        c, r = chosen.detach(), rejected.detach()
        parts = {"accuracy": (c > r).float().sum(), "margin": (c - r).sum()}
        return Loss(per_pair.sum(), torch.tensor(per_pair.numel(), device=per_pair.device), parts)

    loss.__name__ = "reward"
    return loss


def reward_metrics() -> dict[str, Callable]:
    """The figures per pair, for evaluation (which averages them over every pair once)."""

    def accuracy(outputs, targets) -> torch.Tensor:
        return (outputs["rewards_chosen"] > outputs["rewards_rejected"]).float()

    def margin(outputs, targets) -> torch.Tensor:
        return (outputs["rewards_chosen"] - outputs["rewards_rejected"]).detach()

    return {"accuracy": accuracy, "margin": margin}


def score_head(model) -> None:
    """One line for a model that is not a sequence classifier with one output (a causal LM, num_labels != 1)."""
    inner = unwrapped(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # a peft model's
    name = engines.own_class(base).__name__
    if not any(c.__name__.endswith("ForSequenceClassification") for c in type(base).__mro__):
        raise ConfigError(f"--objective reward trains a reward model, a sequence classifier with one output "
                          f"(AutoModelForSequenceClassification with num_labels=1), and {name} is not one: give e.g. "
                          "LlamaForSequenceClassification(config) with config.num_labels = 1")
    labels = getattr(getattr(base, "config", None), "num_labels", None)
    if labels != 1:
        raise ConfigError(f"--objective reward: {name} has {labels} outputs (num_labels={labels}); a reward model "
                          "scores a sequence with one (num_labels=1)")


class RewardModel:
    """`--objective reward` as the run asks it (objectives/__init__.py says what each answer is for)."""

    name = "reward"
    reference = None
    copies_weights = False
    reads_ahead = False
    iterations = 1

    def __init__(self):
        self.notes: list[str] = []

    def per_step(self, cfg: TrainConfig) -> TrainConfig:
        return cfg

    def shape(self, cfg: TrainConfig, job: Workload) -> None:
        """The workload's forward, loss, metrics and (unless the user gave one) collate become the reward model's;
        the model's `pad_token_id` the run's padding token. Other data, models and options are one line."""
        if job.forward is reward_forward:  # set already (the same workload set up again)
            return
        if cfg.dpo_beta != 0.1 or cfg.dpo_reference != "auto":
            raise ConfigError(f"--{'dpo-beta' if cfg.dpo_beta != 0.1 else 'dpo-reference'} applies with --objective dpo")
        if cfg.train_on_prompt:
            raise ConfigError("--train-on-prompt applies to supervised fine-tuning: a reward model scores whole "
                              "sequences")
        own_forward_and_loss(cfg, job)
        pairs = holds_pairs(job, look=True)
        sft_text = isinstance(job.data.train, (Tokenized, TokenizedStream, Mixture)) and \
            job.data.train.kind not in (None, "preference")
        if (job.collate is None or sft_text) and not pairs:
            raise ConfigError(f"--objective reward trains on preference pairs (prompt, chosen and rejected, as text or "
                              f"chat messages), and {job.dataset_name}'s samples are not such pairs")
        score_head(job.model)
        pad = self._pad(job)
        if job.collate is None or sft_text:
            job.collate = reward_collate(pad, cfg.max_length)
        job.forward, job.loss, job.loss_name = reward_forward, reward_loss(cfg.center_rewards_coefficient), "reward"
        job.metrics = {**reward_metrics(), **(job.metrics or {})}

    def _pad(self, job: Workload) -> int:
        """The padding token, which the score head must know to pool each row's last real token: the tokenizer's
        (its pad token, else its EOS), set as the model's `pad_token_id` as TRL's RewardTrainer sets it; without a
        tokenizer, the model's own."""
        base = unwrapped(job.model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        own = getattr(config, "pad_token_id", None)
        pad = pad_id(job.tokenizer) if job.tokenizer is not None else own
        if pad is None:
            raise ConfigError("--objective reward pads its batches, and neither a tokenizer nor the model's config "
                              "names a padding token: give --tokenizer (or set the model config's pad_token_id)")
        if own != pad:
            self.notes.append(f"--objective reward: the model's pad_token_id set to {pad} (the tokenizer's padding "
                              f"token; it was {own}): the score is read at each row's last other token")
            config.pad_token_id = pad
        return pad

    def start(self, model: torch.nn.Module, reload: Callable | None = None, autocast: Callable | None = None) -> list[str]:
        """Dropout off, as TRL's RewardTrainer turns it off (`disable_dropout`, on by default)."""
        dropout = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        for m in dropout:
            m.p = 0.0
        notes, self.notes = self.notes, []
        return notes + ([f"--objective reward: dropout off in {len(dropout)} layers (as TRL's RewardTrainer)"]
                        if dropout else [])

    def rollouts(self, r, batches):
        return batches

    def read_figures(self, accelerator) -> dict:
        return {}

    def card(self, cfg: TrainConfig, loss: str) -> tuple[str, str]:
        centred = f" + {cfg.center_rewards_coefficient:g} x (chosen + rejected)^2" \
            if cfg.center_rewards_coefficient is not None else ""
        return ("a reward model on preference pairs",
                f"the Bradley-Terry loss, -log sigmoid(chosen - rejected - margin){centred} (TRL's RewardTrainer)")
