"""Online reinforcement learning with GRPO (`--objective grpo`, Shao et al. 2024, DeepSeekMath) on the run's own loop:
at each optimizer step the model writes G completions for each prompt of the global batch, reward functions score
them, and the policy moves toward the completions that scored above their group's mean. The loss, its normalisations
and its figures are TRL 1.16's GRPOTrainer's (`_compute_loss`), fed the same completions.

What differs from TRL, and why it holds the run's guarantees:
- `--batch-size` counts completions, as TRL's; the loader deals prompts, `batch_size / G` a step, so each process
  holds whole groups: a group's mean and standard deviation are its own G rewards, on every topology.
- Each completion is sampled with a generator of its own, keyed by (seed, step, the prompt's index in the set, the
  generation's index): a token is the inverse CDF of its row's filtered distribution at that row's uniform number.
  A group is generated alone ([G, prompt length], no padding), so its logits, and so its completions, are the same
  bits whatever the number of processes, the accumulation, or a resume.
- The step's completions are generated before its first micro-batch (`rollouts`), so the batch's reward deviation
  (`--scale-rewards batch`) and the token counts (`dapo`) are the whole global batch's; each loss returns
  (sum, count) and the loop divides by the global batch's count: bnpo, which TRL normalises by each process's micro-
  batch, is exact here (the same with one process and no accumulation).
- `--num-iterations N` trains N optimizer steps on one generation, the log-probabilities at generation kept.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from accelerate import PartialState
from accelerate.utils import gather_object

from ..config import ConfigError, TrainConfig
from ..distributed.processes import each_tries
from ..workload.losses import Loss
from .dpo import Reference, causal_lm, own_forward_and_loss, start_reference, unwrapped
from .rewards import Applicable, Completions, _nanstd, advantages, reward_functions, score
from .sampling import Sampling, completion_mask, generate_group, generate_rows, key, lockstep

# --------------------------------------------------------------------------------------------------- the loss


def token_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
                temperature: float, autocast: Callable = contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p [rows, C], entropy [rows, C]) of each completion token given what precedes it, under `temperature`
    (TRL scores the tokens at the temperature they were sampled at), in float32, a row of logits at a time."""
    with autocast():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                       logits_to_keep=completion_length + 1).logits
    logits = logits[:, -completion_length - 1:-1]
    targets = input_ids[:, -completion_length:]
    logps, entropies = [], []
    for row, target in zip(logits, targets):  # [C, vocabulary] in float32 at a time, not the whole batch's
        scaled = row.float() / temperature
        log_probs = scaled.log_softmax(-1)
        logps.append(log_probs.gather(1, target[:, None]).squeeze(1))
        entropies.append(-(log_probs.exp() * log_probs).sum(-1).detach())
    return torch.stack(logps), torch.stack(entropies)


@dataclass
class LossOptions:
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    max_completion_length: int = 256


def grpo_loss(logps: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None, advantage: torch.Tensor,
              mask: torch.Tensor, o: LossOptions) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(the loss's sum, its count, figures' sums) of a micro-batch: TRL's clipped surrogate plus beta x its KL
    estimate, per token; the sum normalised as `o.loss_type` says by the count the loop sums over the global batch
    (grpo: each completion's token mean, counted per completion; bnpo, dapo: per token; dr_grpo: per completion x
    the maximum completion length)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old is None else old
    coef_1 = torch.exp(logps - old)
    coef_2 = coef_1.clamp(1 - o.epsilon, 1 + (o.epsilon_high if o.epsilon_high is not None else o.epsilon))
    a = advantage.to(logps.dtype).unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    kl = None
    if o.beta != 0.0:
        # x the ratio to the old policy, as TRL's use_bias_correction_kl (its default): the unbiased reverse-KL gradient
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * coef_1
        per_token = per_token + o.beta * kl
    rows = torch.tensor(float(logps.shape[0]), device=logps.device)
    if o.loss_type == "grpo":
        value, count = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    elif o.loss_type == "dr_grpo":
        value, count = (per_token * mask).sum(), rows * o.max_completion_length
    else:  # bnpo, dapo: over every token of the global batch
        value, count = (per_token * mask).sum(), mask.sum()
    high = o.epsilon_high if o.epsilon_high is not None else o.epsilon
    clipped = ((coef_1 < 1 - o.epsilon) & (a < 0)) | ((coef_1 > 1 + high) & (a > 0))
    figures = {"clip_ratio": (clipped.to(mask.dtype) * mask).sum().detach(),
               "kl": (kl * mask).sum().detach() if kl is not None else None, "tokens": mask.sum().detach()}
    return value, count, figures


# --------------------------------------------------------------------------------------------------- batches


def pad_rows(rows: Sequence[torch.Tensor], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n, longest], mask) of 1-D rows, padded on the left (prompts) or the right (completions)."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros((len(rows), longest), dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        where = slice(longest - len(r), longest) if left else slice(0, len(r))
        ids[i, where], mask[i, where] = r, 1
    return ids, mask


def prompt_collate(samples: list[Mapping]) -> dict:
    """Prompts as the loader deals them: their token ids (a list of 1-D tensors), their indices in the set, and each
    sample's prompt and other columns as given (for the reward functions)."""
    return {"prompt_ids": [s["prompt_ids"] for s in samples],
            "index": torch.tensor([int(s["index"]) for s in samples], dtype=torch.long),
            "rows": [s["row"] for s in samples]}


@dataclass
class Figures:
    """What users read at each log step besides the loss, summed on each process since the last log step."""

    names: list[str]
    sums: dict = field(default_factory=dict)  # name -> a float or a device tensor
    lows: dict[str, float] = field(default_factory=dict)
    highs: dict[str, float] = field(default_factory=dict)
    values: dict[str, list[float]] = field(default_factory=dict)  # each reward given in the interval

    def add(self, name: str, value) -> None:
        """A number, or a tensor kept where it is (the loss's figures: no host sync each micro-batch; read at log
        steps)."""
        self.sums[name] = self.sums.get(name, 0.0) + value

    def extreme(self, name: str, low: float, high: float) -> None:
        self.lows[name] = min(self.lows.get(name, math.inf), low)
        self.highs[name] = max(self.highs.get(name, -math.inf), high)



# --------------------------------------------------------------------------------------------------- the objective


class GRPO:
    """`--objective grpo` as the run asks it (objectives/__init__.py says what each method is for)."""

    name = "grpo"
    reads_ahead = True  # a step's micro-batches are read before its first one trains (the rollout)

    def __init__(self, cfg: TrainConfig, rewards: Sequence | None = None):
        _check(cfg)
        self.cfg, self.group = cfg, cfg.num_generations
        self.functions = reward_functions(rewards if rewards is not None else cfg.rewards or [])
        self.weights = torch.tensor([f.weight for f in self.functions], dtype=torch.float64)
        self.options = LossOptions(cfg.loss_type, cfg.grpo_beta, cfg.epsilon, cfg.epsilon_high,
                                   cfg.max_completion_length)
        mode = cfg.dpo_reference if cfg.dpo_reference != "auto" else "adapter" if cfg.lora else "copy"
        self.reference = Reference(mode) if cfg.grpo_beta != 0 else None
        self.figures = Figures([f.name for f in self.functions])
        self.sampling: Sampling | None = None
        self.tokenizer = None
        self.folder: Path | None = None  # where completions.jsonl goes (the run folder, set by the loop)

    @property
    def iterations(self) -> int:
        return self.cfg.num_iterations

    @property
    def copies_weights(self) -> bool:
        return self.reference is not None and self.reference.mode == "copy"

    def per_step(self, cfg: TrainConfig) -> TrainConfig:
        """The loader deals prompts: `--batch-size` completions are batch_size / G prompts a step."""
        return replace(cfg, batch_size=cfg.batch_size // self.group)

    def shape(self, cfg: TrainConfig, job) -> None:
        if not self.functions:
            raise ConfigError("--objective grpo needs reward functions: --rewards pkg.module:fn (fit(..., rewards=[fn]))")
        train = job.data.train
        if getattr(train, "kind", None) != "prompt":
            raise ConfigError(f"--objective grpo generates from prompts (samples with a 'prompt': text or chat messages, "
                              f"other columns handed to the reward functions), and {job.dataset_name}'s samples are not "
                              "prompts")
        own_forward_and_loss(cfg, job)
        if job.tokenizer is None:
            raise ConfigError("--objective grpo decodes the completions for the reward functions: give --tokenizer")
        causal_lm(job.model, "grpo")
        share = cfg.batch_size // (PartialState().num_processes * cfg.grad_accum)  # a process's prompts a micro-batch
        if share % cfg.generation_groups:  # (--micro-batch auto's, known later, is checked at the first step)
            raise ConfigError(f"--generation-groups {cfg.generation_groups}: each process holds {share} prompts a "
                              f"micro-batch, not a multiple of {cfg.generation_groups}")
        self.tokenizer = job.tokenizer
        eos = getattr(getattr(unwrapped(job.model), "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else job.tokenizer.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,) if eos is not None else ()
        pad = job.tokenizer.pad_token_id if job.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
        self.sampling = Sampling(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, eos, pad)
        job.forward, job.loss, job.loss_name, job.collate = self.forward, self.loss, "grpo", prompt_collate
        job.metrics = {**self.evaluation_metrics(), **(job.metrics or {})}

    def start(self, model: torch.nn.Module, reload: Callable | None = None, autocast: Callable | None = None) -> list[str]:
        dropout = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        for m in dropout:
            m.p = 0.0  # the log-probabilities of the model, not of a random mask (TRL: disable_dropout)
        said = [f"{self.cfg.batch_size // self.group} prompts x {self.group} completions = {self.cfg.batch_size} a step "
                "(the global batch above counts prompts)"]
        said += start_reference(self.reference, model, reload, autocast) if self.reference is not None else []
        said += [f"dropout off in {len(dropout)} layers (as TRL's disable_dropout)"] if dropout else []
        return ["--objective grpo: " + "; ".join(said)]

    # ----------------------------------------------------------------------------------------------- the step

    def rollouts(self, r, batches) -> Iterator:
        """The loop's micro-batches: each step's prompts (its `grad_accum` micro-batches on this process) read, their
        completions generated and scored, then handed out; each generation trained on `--num-iterations` steps."""
        self.folder = r.output.folder
        guarded = r.job.data.kind.train.guarded  # (batch, indices of unreadable samples): the indices go on with it
        it = iter(batches)
        while True:
            read = [b for _, b in zip(range(r.cfg.grad_accum), it)]
            if not read:
                return
            since = time.perf_counter()
            made = self.rollout(r.trained.model, [b[0] if guarded else b for b in read], r.state.step, r.accelerator)
            self.figures.add("generation_s", time.perf_counter() - since)
            self.figures.add("steps", self.iterations)
            r.clock.paused(forget=True)  # generating is the step's work, not a wait for data
            for _ in range(self.iterations):
                yield from ((m, b[1]) for m, b in zip(made, read, strict=True)) if guarded else made

    def rollout(self, model, prompts: list[Mapping], step: int, accelerator) -> list[dict]:
        """The step's completions, rewards and advantages (and the log-probabilities kept at generation)."""
        policy = unwrapped(model)
        together = lockstep(policy)
        was_training = policy.training
        policy.eval()  # dropout is off already; eval() also turns off what a model does only in training
        try:
            with torch.no_grad(), accelerator.autocast():
                made = [self._generated(policy, batch, step, together) for batch in prompts]
        finally:
            policy.train(was_training)
        scorings, tables = [m.pop("scoring") for m in made], []
        # Every process scores its own completions; a reward function that fails on one is raised on every one, so that
        # none waits for it at the step's next collective.
        each_tries(lambda: tables.append(score(self.functions, functools.reduce(Completions.extend, scorings,
                                                                                Completions()))))
        table = tables[0]
        totals = (table * self.weights).nansum(1).masked_fill(table.isnan().all(1), math.nan)  # none applies: out
        std = None
        if self.cfg.scale_rewards == "batch":
            every = accelerator.gather(totals.to(accelerator.device)) if accelerator.num_processes > 1 else totals
            std = _nanstd(every.double().cpu().sort().values)  # sorted: the same sum in any order of processes
        start = 0
        for m in made:
            rows = len(m["completion_ids"])
            a, total = advantages(table[start:start + rows], self.weights, self.group, self.cfg.scale_rewards, std)
            m["advantages"] = a.to(m["completion_ids"].device)
            self._count(table[start:start + rows], total, m)
            start += rows
        self._with_log_probs(model, made, accelerator)
        self._log_completions(made, scorings, table, step, accelerator)
        return made

    def _generated(self, policy, batch: Mapping, step: int, together) -> dict:
        """One micro-batch of prompts -> its G completions each, as the training batch (prompts left-padded,
        completions right-padded), with what the reward functions are given."""
        prompts, completions, scoring, pack = [], [], Completions(), self.cfg.generation_groups
        given = list(zip(batch["prompt_ids"], batch["index"].tolist(), batch["rows"], strict=True))
        if len(given) % pack:
            raise ConfigError(f"--generation-groups {pack}: this process's micro-batch holds {len(given)} prompts, not a "
                              f"multiple of {pack} (prompts are generated {pack} at a time)")
        for start in range(0, len(given), pack):  # each pack's rows in one batch: G a prompt, each with its key
            part = given[start:start + pack]
            keys = [key(self.cfg.seed, step, index, g) for _, index, _ in part for g in range(self.group)]
            made = generate_rows(policy, [ids for ids, _, _ in part for _ in range(self.group)], keys, self.sampling,
                                 together)
            for j, (ids, _, row) in enumerate(part):
                mine = made[j * self.group:(j + 1) * self.group]
                prompts += [ids] * self.group
                completions += list(mine)
                _scored(scoring, row, mine, self.sampling, self.tokenizer)
        prompt_ids, prompt_mask = pad_rows(prompts, self.sampling.pad, left=True)
        completion_ids, _ = pad_rows(completions, self.sampling.pad, left=False)
        mask, cut = completion_mask(completion_ids, self.sampling.eos)
        length = mask.sum(1)
        if self.cfg.mask_truncated_completions:
            mask = mask * (~cut).long().unsqueeze(1)
        indices = [(index, g) for index in batch["index"].tolist() for g in range(self.group)]
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": mask, "cut": cut, "length": length, "indices": indices, "scoring": scoring,
                "rollout": True}

    def _with_log_probs(self, model, made: list[dict], accelerator) -> None:
        """The log-probabilities at generation (--num-iterations above 1) and the reference's (--grpo-beta)."""
        if self.iterations == 1 and self.reference is None:
            return
        with torch.no_grad():
            for m in made:
                ids, mask, width = _joined_ids(m)
                if self.iterations > 1:
                    with accelerator.autocast():
                        m["old_logps"] = token_logps(model, ids, mask, width, self.cfg.temperature)[0]
                if self.reference is not None:
                    with self.reference.model(model, ids.device) as (reference, autocast):
                        m["ref_logps"] = token_logps(reference, ids, mask, width, self.cfg.temperature, autocast)[0]

    def forward(self, model, batch: Mapping):
        """(outputs, None): the completions' log-probabilities with what the loss compares them with; in evaluation,
        each prompt's greedy completion and its rewards."""
        if not batch.get("rollout"):
            device = batch["prompt_ids"][0].device
            if model.training or device.type == "meta":
                batch = self._stand_in(batch)  # the first-sample check and FLOPs: a completion of the longest length
            else:
                return self._evaluated(model, batch), None
        ids, mask, width = _joined_ids(batch)
        logps, entropy = token_logps(model, ids, mask, width, self.cfg.temperature)
        ref = batch.get("ref_logps")
        if ref is None and self.reference is not None:  # the stand-in's: the model before start is its own reference
            ref = logps.detach()
        return {"logps": logps, "entropy": entropy, "old_logps": batch.get("old_logps"),
                "ref_logps": ref, "advantages": batch["advantages"], "mask": batch["completion_mask"],
                "rollout": bool(batch.get("rollout"))}, None

    def loss(self, outputs, targets) -> Loss | None:
        if "logps" not in outputs:  # evaluation: judged by its rewards, not a loss
            return None
        value, count, figures = grpo_loss(outputs["logps"], outputs["old_logps"], outputs["ref_logps"],
                                          outputs["advantages"], outputs["mask"], self.options)
        if outputs["rollout"]:
            for name in ("clip_ratio", "kl", "tokens"):
                if figures[name] is not None:
                    self.figures.add(name, figures[name])
            self.figures.add("entropy", (outputs["entropy"] * outputs["mask"]).sum())
        return Loss(value, count)

    def _stand_in(self, batch: Mapping) -> dict:
        rows = len(batch["prompt_ids"])
        prompt_ids, prompt_mask = pad_rows(list(batch["prompt_ids"]), self.sampling.pad, left=True)
        device = prompt_ids.device
        completion = torch.full((rows, self.sampling.max_new), self.sampling.pad, dtype=torch.long, device=device)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion,
                "completion_mask": torch.ones_like(completion), "advantages": torch.ones(rows, device=device)}

    def _evaluated(self, model, batch: Mapping) -> dict:
        """Each prompt's greedy completion (generated alone: the same on every topology) and its rewards."""
        policy = unwrapped(model)
        completions, scoring = [], Completions()
        for ids, row in zip(batch["prompt_ids"], batch["rows"], strict=True):
            made = generate_group(policy, ids, None, self.sampling, lockstep(policy))
            completions.append(made[0])
            _scored(scoring, row, made, self.sampling, self.tokenizer)
        table = score(self.functions, scoring)
        device = batch["prompt_ids"][0].device
        ids, _ = pad_rows(completions, self.sampling.pad, left=False)
        mask, cut = completion_mask(ids, self.sampling.eos)
        total = (table * self.weights).nansum(1).masked_fill(table.isnan().all(1), math.nan)  # none applies: left out
        return {"rewards": table.to(device), "reward": total.to(device),
                "length": mask.sum(1).double(), "cut": cut.double()}

    def evaluation_metrics(self) -> dict[str, Callable]:
        def column(name: str, pick: Callable) -> Callable:
            def metric(outputs, targets) -> torch.Tensor:
                return pick(outputs)

            metric.__name__ = name
            return metric

        metrics = {f"rewards/{f.name}": Applicable(lambda o, j=j: o["rewards"][:, j]) for j, f in enumerate(self.functions)}
        return {**metrics, "reward": Applicable(lambda o: o["reward"]),
                "completion_length": column("completion_length", lambda o: o["length"]),
                "clipped_ratio": column("clipped_ratio", lambda o: o["cut"])}

    # ----------------------------------------------------------------------------------------------- what users read

    def card(self, cfg: TrainConfig, loss: str) -> tuple[str, str]:
        rewards = ", ".join(f"`{f.name}`" + (f" x {f.weight:g}" if f.weight != 1 else "") for f in self.functions)
        reference = "" if self.reference is None else ", KL to " + (
            "the model with its adapters off" if self.reference.mode == "adapter" else
            "a frozen copy of the starting weights") + f" x {self.options.beta:g}"
        return ("GRPO on prompts, scored by reward functions",
                f"GRPO's clipped surrogate ({self.options.loss_type}), {self.group} completions a prompt of at most "
                f"{cfg.max_completion_length} tokens, rewards {rewards}, advantages scaled per {cfg.scale_rewards}"
                f"{reference}; a step's batch: {cfg.batch_size} prompts")

    def _count(self, table: torch.Tensor, total: torch.Tensor, made: dict) -> None:
        f = self.figures
        f.add("completions", len(total))
        for j, name in enumerate(f.names):
            f.values.setdefault(name, []).extend(v for v in table[:, j].tolist() if not math.isnan(v))
        f.values.setdefault("reward", []).extend(v for v in total.tolist() if not math.isnan(v))
        lengths = made["length"].double()
        f.add("sum/length", lengths.sum())
        f.add("cut", made["cut"].sum())
        f.extreme("length", float(lengths.min()), float(lengths.max()))

    def read_figures(self, accelerator) -> dict:
        """The figures of the log interval over every process (one gather of a few numbers and of the interval's
        rewards), then a new interval."""
        f = self.figures
        names = sorted(f.sums)
        if not names:
            return {}
        mine = [float(f.sums[n]) for n in names] + [-f.lows.get("length", math.inf), f.highs.get("length", -math.inf)]
        rows = torch.tensor([mine], dtype=torch.float64, device=accelerator.device)
        several = accelerator.num_processes > 1
        rows = accelerator.gather(rows) if several else rows
        values = gather_object([f.values]) if several else [f.values]
        total = dict(zip(names, rows[:, :len(names)].sum(0).tolist(), strict=True))
        out = {}
        for name in [*f.names, "reward"]:  # mean and (unbiased) deviation over the completions each applies to
            scored = torch.tensor([v for part in values for v in part.get(name, [])], dtype=torch.float64)
            mean, std = (scored.mean().item(), scored.std().item()) if len(scored) else (math.nan, math.nan)
            out.update({"reward": mean, "reward_std": std} if name == "reward" else
                       {f"rewards/{name}/mean": mean, f"rewards/{name}/std": std})
        completions, tokens = total.get("completions", 0) or 1, total.get("tokens", 0) or 1
        out.update({"completions/mean_length": total.get("sum/length", 0) / completions,
                    "completions/min_length": -rows[:, -2].max().item(), "completions/max_length": rows[:, -1].max().item(),
                    "completions/clipped_ratio": total.get("cut", 0) / completions,
                    "clip_ratio": total.get("clip_ratio", 0) / tokens, "entropy": total.get("entropy", 0) / tokens,
                    # the slowest process's, a step: the others wait for it at the step's first collective
                    "generation_time_s": (rows[:, names.index("generation_s")].max() / rows[:, names.index("steps")].max()
                                          ).item() if "generation_s" in names else 0.0,
                    **({"kl": total["kl"] / tokens} if "kl" in total else {})})
        f.sums, f.lows, f.highs, f.values = {}, {}, {}, {}
        return out

    def _log_completions(self, made: list[dict], scorings: list[Completions], table: torch.Tensor, step: int,
                         accelerator) -> None:
        """--log-completions N: the step's completions with their rewards, every process's, by the main process."""
        every = self.cfg.log_completions
        if not every or (step + 1) % every or self.folder is None:
            return
        rows, start = [], 0
        for m, s in zip(made, scorings, strict=True):
            for i, (prompt, text) in enumerate(zip(s.prompts, s.completions, strict=True)):
                values = table[start + i].tolist()
                rows.append({"step": step + 1, "prompt_index": m["indices"][i][0], "generation": m["indices"][i][1],
                             "prompt": prompt, "completion": text, "length": int(m["length"][i]), "cut": bool(m["cut"][i]),
                             "rewards": {f.name: None if math.isnan(v) else v for f, v in zip(self.functions, values,
                                                                                               strict=True)},
                             "reward": float((table[start + i] * self.weights).nansum()),
                             "advantage": float(m["advantages"][i])})
            start += len(s.prompts)
        everyone = gather_object(rows) if accelerator.num_processes > 1 else rows
        if accelerator.is_main_process:
            with open(self.folder / "completions.jsonl", "a") as out:
                for row in sorted(everyone, key=lambda row: (row["prompt_index"], row["generation"])):
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")


def _check(cfg: TrainConfig) -> None:
    """GRPO's options that cannot work, in one line each (before any process starts its work)."""
    if cfg.num_generations < 2:
        raise ConfigError(f"--num-generations must be at least 2 (a prompt's completions are compared with each "
                          f"other), got {cfg.num_generations}")
    if cfg.batch_size % cfg.num_generations:
        raise ConfigError(f"--batch-size {cfg.batch_size} counts completions and must be a multiple of "
                          f"--num-generations {cfg.num_generations} (whole groups of a prompt's completions)")
    for name, low, high in (("max_completion_length", 1, None), ("temperature", 0, None), ("top_p", 0, 1),
                            ("generation_groups", 1, None),
                            ("top_k", 0, None), ("epsilon", 0, 1), ("num_iterations", 1, None),
                            ("log_completions", 0, None), ("epsilon_high", 0, None)):
        value = getattr(cfg, name)
        if value is not None and (value < low or (high is not None and value > high)
                                  or (name in ("temperature", "top_p") and value == 0)):
            raise ConfigError(f"--{name.replace('_', '-')} out of range: {value}")
    if cfg.train_on_prompt:
        raise ConfigError("--train-on-prompt applies to supervised fine-tuning; GRPO trains on its completions")
    if cfg.checkpoint_steps and cfg.checkpoint_steps % cfg.num_iterations:
        raise ConfigError(f"--checkpoint-every {cfg.checkpoint_steps} inside a generation trained on for --num-iterations "
                          f"{cfg.num_iterations} steps: checkpoints (where a run resumes) at multiples of it")
    if cfg.pack is not None:
        raise ConfigError("--pack applies to token data; GRPO generates from prompts one group at a time")


def _scored(scoring: Completions, row: Mapping, made: torch.Tensor, s: Sampling, tokenizer) -> None:
    """Adds one prompt's completions to what the reward functions are given."""
    prompts, completions, ids, columns = scoring.prompts, scoring.completions, scoring.completion_ids, scoring.columns
    chat = isinstance(row["prompt"], list)
    mask, _ = completion_mask(made, s.eos)
    for completion, keep in zip(made, mask, strict=True):
        tokens = completion[keep.bool()].tolist()
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        prompts.append(row["prompt"])
        completions.append([{"role": "assistant", "content": text}] if chat else text)
        ids.append(tokens)
        for name, value in row.items():
            if name not in ("prompt", "completion", "completion_ids"):
                columns.setdefault(name, []).append(value)


def _joined_ids(batch: Mapping) -> tuple[torch.Tensor, torch.Tensor, int]:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return ids, mask, batch["completion_ids"].shape[1]
