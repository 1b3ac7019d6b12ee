"""A language model judged by what it writes (`--judge`): at every evaluation, each held-out chat or prompt/completion
sample is continued before its last answer (the conversation before its last assistant turn, the prompt before its
completion), greedily and alone (its logits, and so its text, the same on every topology), up to `--max-new-tokens`,
and judge functions score the text against that answer, the sample's reference. `exact_match` is built in; a function
of one's own is an import path or a callable taking what a GRPO reward function takes, with `references` beside it:
fn(prompts, completions, completion_ids, references, **columns) -> a float (or None: it does not apply) per sample, so
GRPO's reward functions fit here. What users read: `eval_judged/<fn>`, each function's mean over the samples it
applies to, every sample counted once over every process (rewards.Applicable)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from ..config import ConfigError, TrainConfig
from ..language.generation import answer_start
from ..workload import losses
from .dpo import unwrapped
from .rewards import Applicable, Completions, reward_functions, score
from .sampling import Sampling, completion_mask, generate_group, lockstep


def exact_match(prompts, completions, references, **columns) -> list[float]:
    """1 where the text written is the reference (surrounding white space aside), else 0."""
    return [float(c.strip() == r.strip()) for c, r in zip(completions, references, strict=True)]


BUILT_IN = {"exact_match": exact_match}


def attach(cfg: TrainConfig, job, given=None) -> None:
    """--judge (fit's `judge=`): the workload's forward, in evaluation, also writes and judges; its metrics gain each
    function's mean. One line for data without answers to judge, or without a tokenizer."""
    names = given if given is not None else cfg.judge or []
    functions = reward_functions([BUILT_IN.get(n, n) if isinstance(n, str) else n for n in names])
    if not functions:
        return
    if job.tokenizer is None:
        raise ConfigError("--judge decodes what the model writes: give --tokenizer")
    if getattr(job.data.eval, "kind", None) not in ("messages", "prompt_completion"):
        raise ConfigError("--judge compares what the model writes with each evaluation sample's answer: it takes an "
                          "evaluation set of chat or prompt/completion data")
    eos = job.tokenizer.eos_token_id
    pad = job.tokenizer.pad_token_id if job.tokenizer.pad_token_id is not None else eos
    sampling = Sampling(cfg.max_new_tokens, eos=(eos,) if eos is not None else (), pad=pad if pad is not None else 0)
    job.forward = judging(job.forward or losses.forward, functions, sampling, job.tokenizer)
    job.metrics = {**(job.metrics or {}), **{f"judged/{f.name}": Applicable(lambda o, j=j: o["judged"][:, j])
                                             for j, f in enumerate(functions)}}


def judging(forward: Callable, functions: list, sampling: Sampling, tokenizer) -> Callable:
    """forward(model, batch) -> (outputs, targets): `forward`'s, and in evaluation `outputs["judged"]`, [samples,
    functions] float64 (NaN where a function does not apply, or the sample has no answer)."""

    def judged(model, batch):
        outputs, targets = forward(model, batch)
        if model.training or not isinstance(batch, Mapping) or "labels" not in batch \
                or batch["input_ids"].device.type == "meta":
            return outputs, targets
        if not isinstance(outputs, Mapping):
            raise ConfigError("--judge adds what it measures to the model's outputs, which must be a dict "
                              f"(transformers' are), not {type(outputs).__name__}")
        outputs["judged"] = _scores(model, batch, functions, sampling, tokenizer)
        return outputs, targets

    judged.__name__ = "judged"
    return judged


def _scores(model, batch: Mapping, functions: list, s: Sampling, tokenizer) -> torch.Tensor:
    policy, made, answered = unwrapped(model), Completions(columns={"references": []}), []
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    for i, row in enumerate(ids):
        kept = mask[i].bool() if mask is not None else torch.ones_like(row, dtype=torch.bool)
        start = answer_start(batch["labels"][i][kept])
        prompt, reference = row[kept][:start], row[kept][start:]
        answered.append(bool(len(reference)))
        if not len(reference):  # no answer to judge (a sample left whole): left out
            continue
        written = generate_group(policy, prompt, None, s, lockstep(policy))
        keep, _ = completion_mask(written, s.eos)
        tokens = written[0][keep[0].bool()].tolist()
        made.prompts.append(tokenizer.decode(prompt, skip_special_tokens=True))
        made.completions.append(tokenizer.decode(tokens, skip_special_tokens=True))
        made.completion_ids.append(tokens)
        made.columns["references"].append(tokenizer.decode(reference, skip_special_tokens=True))
    table = torch.full((len(ids), len(functions)), float("nan"), dtype=torch.float64)
    if made.prompts:
        table[torch.tensor(answered)] = score(functions, made)
    return table.to(ids.device)
