"""Reward functions as TRL takes them, called on a step's completions, and the advantages made of their rewards."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import IMPORT_PATH, ConfigError, first_line
from ..workload.components import import_object
from ..workload.metrics import Stateful


@dataclass
class RewardFunction:
    """A reward function as TRL takes one: fn(prompts, completions, completion_ids, **columns) -> one float (or None:
    it does not apply) per completion; `weight` in the total."""

    fn: Callable
    name: str
    weight: float = 1.0


def reward_functions(given: Sequence, weights: Sequence[float] | None = None) -> list[RewardFunction]:
    """Callables, import paths (`pkg.module:fn`, `pkg.module:fn=2.0` for a weight), reward-model folders (`model:PATH`
    or a folder's path, `=2.0` likewise: `model_reward`), or RewardFunction objects."""
    out = []
    for i, item in enumerate(given):
        if isinstance(item, RewardFunction):
            out.append(item)
            continue
        weight = 1.0
        item = os.fspath(item) if isinstance(item, os.PathLike) else item
        if isinstance(item, str):
            path, _, w = item.partition("=")
            try:
                weight = float(w) if w else 1.0
            except ValueError:
                raise ConfigError(f"--reward {item}: the weight after '=' must be a number") from None
            folder = _reward_model_folder(path)
            if folder is not None:
                out.append(model_reward(folder, weight))
                continue
            fn, name = import_object(path, "--reward"), path.rpartition(":")[2]
        else:
            fn, name = item, getattr(item, "__name__", type(item).__name__)
        if not callable(fn):
            raise ConfigError(f"reward {name} is not callable")
        out.append(RewardFunction(fn, name, weight))
    if weights is not None:
        if len(weights) != len(out):
            raise ConfigError(f"{len(weights)} reward weights for {len(out)} reward functions")
        out = [RewardFunction(r.fn, r.name, float(w)) for r, w in zip(out, weights, strict=True)]
    names = [r.name for r in out]
    for name in set(names):  # two functions of one name are told apart by their place
        if names.count(name) > 1:
            out = [RewardFunction(r.fn, f"{r.name}_{i}" if r.name == name else r.name, r.weight)
                   for i, r in enumerate(out)]
    return out


def _reward_model_folder(path: str) -> Path | None:
    """The folder `path` names as a reward model (`model:PATH`, or the path of a folder), or None: an import path (a
    module named `model` too, when no such folder exists)."""
    folder = path[len("model:"):] if path.startswith("model:") else path
    if folder and Path(folder).is_dir():
        return Path(folder)
    if path.startswith("model:") and not IMPORT_PATH.match(path):
        raise ConfigError(f"--rewards {path}: no such folder (a reward model's folder, which "
                          "AutoModelForSequenceClassification.from_pretrained loads: a --objective reward run's)")
    return None


class ModelReward:
    """A reward model's folder as a reward function: fn(prompts, completions, **columns) -> the model's score of each
    prompt + completion, tokenized as the reward model's pairs were (text.tokenize_pair: text with the EOS token
    appended, messages through the chat template with the completion's message, and the sample's `tools`), in batches
    of `batch` sequences, in evaluation mode, without gradients, on the run's device."""

    def __init__(self, model, tokenizer, batch: int = 16):
        from ..data.text import pad_id

        self.model, self.tokenizer, self.batch = model, tokenizer, batch
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = pad_id(tokenizer)  # where the score head pools: each row's last real token
        self.pad = config.pad_token_id

    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> list[float]:
        from ..data.text import tokenize_pair

        tools = columns.get("tools")
        rows = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            pair = {"prompt": prompt, "chosen": completion, "rejected": completion}
            if tools is not None and tools[i] is not None:
                pair["tools"] = tools[i]
            ids = tokenize_pair(self.tokenizer, pair)
            rows.append(ids["prompt_ids"] + ids["chosen_ids"])
        device = _device()
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        out = []
        with torch.no_grad():
            for start in range(0, len(rows), self.batch):
                part = rows[start:start + self.batch]
                longest = max(len(r) for r in part)
                ids = torch.full((len(part), longest), self.pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, r in enumerate(part):
                    ids[j, :len(r)], mask[j, :len(r)] = torch.tensor(r, dtype=torch.long), 1
                logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                out += logits.squeeze(-1).float().tolist()
        return out


def _device() -> torch.device:
    """The run's device once a run has one (Accelerate's state), else the CPU."""
    from accelerate.state import PartialState

    return PartialState().device if PartialState._shared_state else torch.device("cpu")


def model_reward(folder: Path, weight: float = 1.0) -> RewardFunction:
    """The reward model of `folder` (AutoModelForSequenceClassification and AutoTokenizer, loaded once, frozen, in
    evaluation mode) as a reward function named after the folder; one line for a folder that is not one."""
    try:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
    except ImportError as e:
        raise ConfigError(f"--rewards {folder}: a reward model needs transformers ({first_line(e)})") from None
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(folder))
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - a folder that is not a model is the user's input
        raise ConfigError(f"--rewards {folder}: does not load as a reward model with its tokenizer "
                          f"(AutoModelForSequenceClassification, AutoTokenizer): {type(e).__name__}: {first_line(e)}") \
            from None
    if getattr(model.config, "num_labels", None) != 1:
        raise ConfigError(f"--rewards {folder}: {type(model).__name__} has {model.config.num_labels} outputs; a reward "
                          "model has one (num_labels=1)")
    return RewardFunction(ModelReward(model.eval().requires_grad_(False), tokenizer), folder.resolve().name, weight)


@dataclass
class Completions:
    """What the reward functions are given, as TRL hands it over: each completion's prompt as given, the completion
    decoded (an assistant message for a chat prompt), its token ids up to its end, and every other column."""

    prompts: list = field(default_factory=list)
    completions: list = field(default_factory=list)
    completion_ids: list = field(default_factory=list)
    columns: dict = field(default_factory=dict)

    def extend(self, other: "Completions") -> "Completions":
        self.prompts += other.prompts
        self.completions += other.completions
        self.completion_ids += other.completion_ids
        for name, values in other.columns.items():
            self.columns.setdefault(name, []).extend(values)
        return self


def score(functions: Sequence[RewardFunction], made: Completions) -> torch.Tensor:
    """[completions, functions] float64 rewards (NaN where a function returned None). A function that raises,
    returns another number of rewards, or a NaN or infinite reward is one line naming it and the prompt."""
    prompts, completions = made.prompts, made.completions
    table = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float64)
    for j, r in enumerate(functions):
        try:
            values = r.fn(prompts=prompts, completions=completions, completion_ids=made.completion_ids, **made.columns)
        except Exception as error:
            raise ConfigError(f"the reward function {r.name} raised {type(error).__name__}: {first_line(error)} "
                              f"(on the prompt {_short(prompts[0])})") from error
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise ConfigError(f"the reward function {r.name} returned {len(values)} rewards for {len(completions)} "
                              f"completions (prompts such as {_short(prompts[0])}): one per completion")
        for i, v in enumerate(values):
            if v is None:
                continue
            try:
                value = float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"the reward function {r.name} returned {v!r} for the prompt {_short(prompts[i])}: "
                                  "a number or None") from None
            if not math.isfinite(value):
                raise ConfigError(f"the reward function {r.name} returned {value} for the prompt "
                                  f"{_short(prompts[i])}: rewards must be finite (None: the function does not apply)")
            table[i, j] = value
    return table


def _short(prompt) -> str:
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def _nanstd(x: torch.Tensor) -> torch.Tensor:
    """TRL's nanstd: the unbiased standard deviation over the values that are not NaN (NaN for fewer than two)."""
    count = (~x.isnan()).sum(-1)
    mean = x.nanmean(-1, keepdim=True)
    variance = ((x - mean) ** 2).nanmean(-1) * count / (count - 1)
    return variance.sqrt()


def advantages(table: torch.Tensor, weights: torch.Tensor, group: int, scale: str,
               batch_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage [n], total reward [n]) of rewards [n, functions] in groups of `group` consecutive rows, as TRL's
    `sum_then_normalize`: the weighted sum, less its group's mean, over its group's (or `batch_std`, the global
    batch's) standard deviation + 1e-4; a completion no function scored gets 0."""
    unscorable = table.isnan().all(1)
    total = (table * weights).nansum(1)
    total[unscorable] = math.nan
    grouped = total.view(-1, group)
    mean = grouped.nanmean(1).repeat_interleave(group)
    out = total - mean
    if scale == "group":
        out = out / (_nanstd(grouped).repeat_interleave(group) + 1e-4)
    elif scale == "batch":
        out = out / (batch_std + 1e-4)
    return torch.nan_to_num(out, nan=0.0), total


class Applicable(Stateful):
    """A reward function's mean in evaluation over the completions it applies to (None: left out, as TRL's nanmean),
    every process's summed: (sum, count)."""

    def __init__(self, pick: Callable):
        self.pick = pick
        super().__init__(0)

    def size(self) -> tuple:
        return (2,)

    def update(self, outputs, targets) -> None:
        values = self.pick(outputs).double()
        scored = values[~values.isnan()]
        self.sums = self.sums.to(values.device) + torch.stack([scored.sum(), values.new_tensor(len(scored))])

    def compute(self, sums: torch.Tensor, rows) -> float:
        return float(sums[0] / sums[1]) if sums[1] else math.nan
