"""Preference pairs trained with DPO (`--objective dpo`, Rafailov et al. 2023) on the run's own loop: the workload's
forward, loss, metrics and collate, as TRL 1.16's DPOTrainer computes them (its sigmoid loss, `beta` 0.1 by default).

A batch holds B pairs as 2B rows (text.preference_collate: the chosen rows, then the rejected ones). Each row's
log-probability is the sum over its completion's tokens of log p(token | what precedes it), in float32. The
reference's come from the frozen starting weights: with LoRA the same model with its adapters switched off (no second
copy), otherwise a frozen copy taken once the starting weights are in place (after --init-from, before the first step;
a resume copies the model as built, with --init-from's weights loaded again). The loss returns (sum over the pairs,
pairs), so the loop divides by the pairs of the whole global batch: exact over processes and accumulation. What users
read, per pair: `rewards_chosen` and `rewards_rejected` (beta x the log-probability ratio to the reference),
`reward_margin` (their difference) and `reward_accuracy` (the share of pairs whose chosen reward is the higher), in
metrics.jsonl at each log step and at every evaluation.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError, TrainConfig
from ..data.mixtures import Mixture
from ..data.text import Tokenized, pad_id, preference_collate
from ..data.text_streams import TokenizedStream
from ..workload.components import Workload
from ..workload.losses import Loss, chunked, no_cache

PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
FIGURES = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def sequence_logps(model, batch: Mapping, autocast: Callable = contextlib.nullcontext) -> torch.Tensor:
    """Per row of `batch` (input_ids, attention_mask, completion_mask): the sum over its completion's tokens of
    log p(token | the tokens before it), in float32; the model's forward under `autocast`. The logits are taken in
    float32 a chunk of positions at a time (losses.chunked): never the whole [rows, tokens, vocabulary] in float32."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with autocast():
        logits = model(**inputs, **no_cache(model, inputs)).logits
    # Each position's next token; the last position's (a stand-in) is dropped. The logits stay whole: logits[:, :-1]
    # flattened would be a copy.
    targets = F.pad(batch["input_ids"][:, 1:], (0, 1))
    per_token = chunked(token_logps, logits.flatten(0, 1), targets.flatten()).view_as(targets)[:, :-1]
    return (per_token * batch["completion_mask"][:, 1:]).sum(1)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of `logits` [n, vocabulary], [n]."""
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(-1)


def unwrapped(model):
    """The model inside DDP's, DeepSpeed's and torch.compile's wrappers (the forward is given the prepared one)."""
    for _ in range(3):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


class Reference:
    """Where the reference log-probabilities come from: `adapter` (the trained model with its LoRA adapters off) or
    `copy` (a frozen copy of the starting weights, set by `start`). Before `start` (the first-sample check and the
    count of FLOPs, on the model as built) the model itself is its own reference. `autocast`: the run's mixed
    precision (the Accelerator's), which `prepare` gives the policy's forward and the copy, made before it, lacks."""

    def __init__(self, mode: str):
        self.mode = mode
        self.started = False
        self.copy: torch.nn.Module | None = None
        self.autocast: Callable = contextlib.nullcontext

    def logps(self, model, batch: Mapping) -> torch.Tensor:
        with torch.no_grad(), self.model(model, batch["input_ids"].device) as (reference, autocast):
            return sequence_logps(reference, batch, autocast)

    @contextlib.contextmanager
    def model(self, model, device: torch.device):
        """(the reference model, the autocast to run it under), for the forward of `model` on `device`."""
        if self.mode == "adapter" and self.started:
            base = unwrapped(model)
            with base.disable_adapter(), _evaluating(base):
                yield base, self.autocast
        elif self.copy is None or device.type == "meta":  # FLOPs counted on the meta device: the same forward
            yield model, contextlib.nullcontext
        else:
            if next(self.copy.parameters()).device != device:
                self.copy.to(device)  # once: the copy stays where it was made until the first step needs it
            yield self.copy, self.autocast


@contextlib.contextmanager
def _evaluating(module: torch.nn.Module):
    """The adapters-off reference in evaluation mode; each module's own mode back afterwards (frozen BatchNorm layers
    stay in evaluation mode: loop._training_mode)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        module.train(modes[0][1])  # train() itself: a model's own override runs (transformers' kernels)
        for m, training in modes[1:]:
            if m.training != training:  # the few kept otherwise (frozen BatchNorm layers)
                m.train(training)


class DPOForward:
    """forward(model, batch) -> (outputs, None): the four log-probabilities of the batch's pairs, [B] each."""

    def __init__(self, reference: Reference):
        self.reference = reference

    def __call__(self, model, batch: Mapping):
        chosen, rejected = sequence_logps(model, batch).chunk(2)
        ref_chosen, ref_rejected = self.reference.logps(model, batch).chunk(2)
        return {"chosen_logps": chosen, "rejected_logps": rejected,
                "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}, None


def rewards(outputs: Mapping, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """beta x log(policy / reference) of the chosen and of the rejected completions, [B] each."""
    return (beta * (outputs["chosen_logps"] - outputs["ref_chosen_logps"]),
            beta * (outputs["rejected_logps"] - outputs["ref_rejected_logps"]))


def dpo_loss(beta: float = 0.1) -> Callable:
    """loss(outputs, targets) -> Loss(sum over the pairs of -log sigmoid(chosen reward - rejected reward), the
    number of pairs, the figures summed over the pairs)."""

    def loss(outputs, targets) -> Loss:
        chosen, rejected = rewards(outputs, beta)
        per_pair = -F.logsigmoid(chosen - rejected)
        c, r = chosen.detach(), rejected.detach()
        parts = {"rewards_chosen": c.sum(), "rewards_rejected": r.sum(), "reward_margin": (c - r).sum(),
                 "reward_accuracy": (c > r).float().sum()}
        return Loss(per_pair.sum(), torch.tensor(per_pair.numel(), device=per_pair.device), parts)

    loss.__name__ = "dpo"
    return loss


def dpo_metrics(beta: float = 0.1) -> dict[str, Callable]:
    """The figures per pair, for evaluation (which averages them over every pair once)."""

    def figure(name: str) -> Callable:
        def metric(outputs, targets) -> torch.Tensor:
            c, r = (x.detach() for x in rewards(outputs, beta))
            return {"rewards_chosen": c, "rewards_rejected": r, "reward_margin": c - r,
                    "reward_accuracy": (c > r).float()}[name]

        metric.__name__ = name
        return metric

    return {name: figure(name) for name in FIGURES}


class DPO:
    """`--objective dpo` as the run asks it (objectives/__init__.py says what each answer is for)."""

    name = "dpo"
    reads_ahead = False
    iterations = 1

    def __init__(self):
        self.forward: DPOForward | None = None

    @property
    def reference(self) -> Reference | None:
        return self.forward.reference if self.forward is not None else None

    @property
    def copies_weights(self) -> bool:
        return self.reference is not None and self.reference.mode == "copy"

    def per_step(self, cfg: TrainConfig) -> TrainConfig:
        return cfg

    def shape(self, cfg: TrainConfig, job: Workload) -> None:
        objective(cfg, job)
        self.forward = job.forward

    def start(self, model: torch.nn.Module, reload: Callable | None = None, autocast: Callable | None = None) -> list[str]:
        return start(self.forward, model, reload, autocast)

    def rollouts(self, r, batches):
        return batches

    def read_figures(self, accelerator) -> dict:
        return {}

    def card(self, cfg: TrainConfig, loss: str) -> tuple[str, str]:
        reference = "the model with its adapters off" if self.reference.mode == "adapter" else \
            "a frozen copy of the starting weights"
        return "DPO on preference pairs", f"DPO's sigmoid loss, beta {cfg.dpo_beta}, the reference {reference}"


def objective(cfg: TrainConfig, job: Workload) -> None:
    """--objective dpo: the workload's forward, loss, metrics and (unless the user gave one) collate become DPO's;
    other data is one line."""
    if isinstance(job.forward, DPOForward):  # set already (the same workload set up again)
        return
    pairs = holds_pairs(job, look=True)
    if not cfg.dpo_beta > 0:
        raise ConfigError(f"--dpo-beta must be positive, got {cfg.dpo_beta}")
    if cfg.train_on_prompt:
        raise ConfigError("--train-on-prompt applies to supervised fine-tuning: DPO compares the completions' "
                          "log-probabilities, never the prompt's")
    own_forward_and_loss(cfg, job)
    # tokenized SFT text (or a mixture of it), padded by data/text.py
    sft_text = isinstance(job.data.train, (Tokenized, TokenizedStream, Mixture)) and \
        job.data.train.kind not in (None, "preference")
    if job.collate is None or sft_text:
        if not pairs:
            raise ConfigError(f"--objective dpo trains on preference pairs (prompt, chosen and rejected, as text or chat "
                              f"messages), and {job.dataset_name}'s samples are not such pairs")
        job.collate = preference_collate(pad_id(job.tokenizer) if job.tokenizer is not None else 0, cfg.max_length)
    causal_lm(job.model, "dpo")
    mode = cfg.dpo_reference if cfg.dpo_reference != "auto" else "adapter" if cfg.lora else "copy"
    if mode == "adapter" and not (cfg.lora or hasattr(job.model, "disable_adapter")):
        raise ConfigError("--dpo-reference adapter is the model with its LoRA adapters switched off: give --lora RANK "
                          "(or a peft model)")
    job.forward, job.loss = DPOForward(Reference(mode)), dpo_loss(cfg.dpo_beta)
    job.loss_name = "dpo"
    job.metrics = {**dpo_metrics(cfg.dpo_beta), **(job.metrics or {})}


def own_forward_and_loss(cfg: TrainConfig, job: Workload) -> None:
    """An objective that computes its own forward and loss (dpo, grpo, reward): one line for a user's given ones."""
    given = [what for what, value in (("--loss", job.loss or cfg.loss), ("--forward", job.forward)) if value is not None]
    if given:
        raise ConfigError(f"--objective {cfg.objective} computes its own forward and loss; leave {given[0]} out")


def causal_lm(model, objective: str) -> None:
    """A model the objective takes the next-token log-probabilities of: one line for one without a language-model
    head (a sequence classifier scores whole sequences)."""
    head = getattr(unwrapped(model), "get_output_embeddings", None)  # a transformers model says whether it has one
    if head is not None and head() is None:
        raise ConfigError(f"--objective {objective} trains a causal language model (its next-token logits, as "
                          f"AutoModelForCausalLM's), and {type(unwrapped(model)).__name__} has no language-model head "
                          "(a sequence classifier scores whole sequences): give a causal LM")


def start_reference(reference: Reference, model: torch.nn.Module, reload: Callable | None = None,
                    autocast: Callable | None = None) -> list[str]:
    """The reference fixed once the starting weights are in place: `model` with its adapters off, or a frozen copy of
    it (which `reload` gives --init-from's weights again on a resume), run under `autocast`."""
    if reference.mode == "adapter" and not hasattr(unwrapped(model), "disable_adapter"):
        raise ConfigError("the reference is the model with its LoRA adapters off, and the model has none to switch "
                          "off; give --lora RANK (or --dpo-reference copy)")
    if reference.mode == "copy":
        reference.copy = copy.deepcopy(unwrapped(model)).eval().requires_grad_(False)
        if reload is not None:
            reload(reference.copy)
    reference.autocast = autocast or contextlib.nullcontext
    reference.started = True
    what = "the model with its LoRA adapters off" if reference.mode == "adapter" else \
        "a frozen copy of the starting weights"
    return [f"the reference is {what}"]


def start(forward, model: torch.nn.Module, reload: Callable | None = None, autocast: Callable | None = None) -> list[str]:
    """Once the starting weights are in place (--init-from, --lora, the same on every process), before anything
    trains: the policy's dropout off, as TRL's DPOTrainer turns it off (`disable_dropout`, on by default: the
    log-probability ratios are then those of the model, not of a random mask), and the reference fixed (a frozen copy
    of `model`, which `reload` gives --init-from's weights again on a resume), run under `autocast` (the run's mixed
    precision). Returns what the start line says."""
    if not isinstance(forward, DPOForward):
        return []
    if forward.reference.mode == "adapter" and not hasattr(unwrapped(model), "disable_adapter"):
        raise ConfigError("--dpo-reference adapter: the model has no LoRA adapters to switch off; give --lora RANK")
    dropout = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    for m in dropout:
        m.p = 0.0
    (said,) = start_reference(forward.reference, model, reload, autocast)
    return [f"--objective dpo: {said}" + (f"; dropout off in {len(dropout)} layers (as TRL's DPOTrainer)"
                                          if dropout else "")]


def holds_pairs(job: Workload, look: bool) -> bool:
    """Whether the training set's samples are tokenized preference pairs: the run's text tokenized as pairs, or (with
    `look`) a map-style set whose first sample is one. Other sets are not read here (a sample that cannot be read is
    --skip-bad-samples' to handle, in the loop)."""
    train = job.data.train
    if isinstance(train, (Tokenized, TokenizedStream, Mixture)) and train.kind is not None:  # tokenized text (a set, a
        # stream), or a mixture of it
        return train.kind == "preference"
    if not look or job.data.kind.train.stream or train is None or not len(train):
        return False
    sample = train[0]
    return isinstance(sample, Mapping) and all(k in sample for k in PAIR_KEYS)
