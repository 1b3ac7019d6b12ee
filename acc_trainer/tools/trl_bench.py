"""`acc-trainer bench-lm` on chat data, preference pairs and prompts: acc_trainer against TRL's SFTTrainer (supervised
fine-tuning on chat messages), DPOTrainer (DPO on prompt/chosen/rejected pairs) and GRPOTrainer (GRPO on prompts with
reward functions), the trainers a fine-tuner would pick instead (docs/language-models.md#speed-against-trl).

lm_bench.main hands a workload over here when its samples are text (chat messages, prompt/completion, text) or its
objective is DPO or GRPO. Both loops get the same model (built from the same factory and seed), the same samples,
the same --max-length (kept from the start), the same per-process and global batch, the same steps, AdamW at a constant
learning rate with the same clipping, and the same precision; each runs in a launch of its own (`accelerate launch
--multi_gpu` for several processes), in rotating order within each repeat. TRL gets what makes it train the same
thing: `assistant_only_loss=True` for messages (acc_trainer's loss is on the assistant's tokens by default), packing
and padding-free off, `bf16=False` unless --mixed-precision bf16 and `gradient_checkpointing=False` (TRL's configs turn
both on by default), the AdamW implementation acc_trainer runs (fused with --fused-optimizer, TRL's default, else
foreach), whole batches only, and for DPO the same beta and a frozen copy of the starting model as `ref_model`
(acc_trainer's reference without LoRA), run on each batch.

Both loops are measured by the same code, in their own processes (`Counter`): a forward pre-hook on the model counts
the tokens of every training forward (one that builds a graph: a reference model's forward does not), and a global
post-hook of torch's optimizers takes the clock (wall and CPU) at each optimizer step. Each process writes what it
trained with (precision, checkpointing, dropout, threads, the optimizer: the bench refuses to compare loops that
differ) and one line per step (`bench-steps-rank<R>.jsonl`: step, time, CPU time, tokens, samples); the harness reads
those logs: the tokens of every process in the steps after --warmup, over rank 0's seconds between the end of step
--warmup and the end of the last (and over every process's CPU seconds in them).
Tokens: for supervised fine-tuning the labelled next tokens (the tokens the loss counts), for DPO the non-padding
tokens of the chosen and rejected sequences (samples: pairs).

GRPO (--objective grpo): both loops get the same model, prompts (each loop's first epoch deals them in the same order:
the step logs show the same prompts at each step, the bench checks it), reward functions and weights, G
(--num-generations), --max-completion-length, --temperature, --top-p, --top-k, --epsilon(-high), --num-iterations,
--scale-rewards, --loss-type, --mask-truncated-completions, beta 0 (TRL's default), the same global batch of
completions and per-process batch (TRL: per_device_train_batch_size counts completions, steps_per_generation =
--grad-accum, so generation_batch_size is the global batch and both generate once per optimizer step), dropout off
(TRL disable_dropout=True, as acc_trainer), TRL generating with transformers' generate (no vLLM). Tokens: the
completion tokens generated (up to and with each one's end-of-sequence token) plus the completion tokens the loss
counts, in the training forwards (the ones that build a graph: the generation's forwards do not count); samples:
completions trained on. Each process also times, with the same wrapper in both, its sampling (acc_trainer's
generate_rows, --generation-groups prompts' G rows at a time; TRL's _generate_single_turn, its whole batch at once)
and its rollout
(sampling, rewards, advantages: acc_trainer's GRPO.rollout, TRL's _generate_and_score_completions), and records
from which prompts it generated.

    cd examples && acc-trainer bench-lm --config stdlib_sft_bench.yaml --processes 1,2 --repeats 3
    cd examples && acc-trainer bench-lm --config arithmetic_grpo_bench.yaml --processes 1,2 --repeats 5 --steps 100 --warmup 10
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError, TrainConfig
from .bench import OPTIMIZER_SHAPING, launched, machine_description, refuse_own_options, tf32_as_acc_trainer
from .trl_counting import Counter, logged_window

LOOPS = ("acc_trainer", "trl")
# Options that trl_loop does not give TRL's trainer: with any of them the two loops would not compute the same thing.
ONLY_ACC_TRAINER = ("lora", "pack", "compile", "ema", "micro_batch", "freeze", "init_from", "label_smoothing",
                    "gradient_checkpointing", *OPTIMIZER_SHAPING)
# GRPO's options that TRL's GRPOTrainer does differently or not at all, as the bench sets it up.
ONLY_ACC_TRAINER_GRPO = ("log_completions",)


def mode_of(cfg: TrainConfig) -> str | None:
    """"sft" for text samples, "dpo" and "grpo" for those objectives, None for anything else (token blocks:
    lm_bench's)."""
    if cfg.objective in ("dpo", "grpo"):
        return cfg.objective
    from ..data.text import sample_kind

    train = samples(cfg)
    first = train[0] if hasattr(train, "__getitem__") and len(train) else None
    kind = sample_kind(first) if first is not None else None
    if kind == "preference":
        raise ConfigError("bench-lm: preference pairs train with --objective dpo")
    if kind == "messages" and not cfg.train_on_prompt:
        _check_trl_takes_the_template(cfg)
    return "sft" if kind is not None else None


def _check_trl_takes_the_template(cfg: TrainConfig) -> None:
    """TRL's SFTTrainer finds the assistant's tokens through a template's {% generation %} blocks, or a training
    template of its own for the ones it knows (get_training_chat_template); any other it refuses after acc_trainer's
    loop has run: one line here instead."""
    from ..data.text import load_chat_template
    from ..workload.components import load_tokenizer

    try:
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    except ImportError:  # TRL missing or moved: the bench's own import says so
        return
    tokenizer = load_chat_template(load_tokenizer(cfg.tokenizer), cfg.chat_template)
    if has_generation_markers(tokenizer.chat_template or ""):
        return
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        source = f"--chat-template {cfg.chat_template}" if cfg.chat_template else f"{cfg.tokenizer}'s chat template"
        raise ConfigError(f"bench-lm against TRL: {source} has no {{% generation %}} blocks and is not one TRL "
                          "knows, so TRL's SFTTrainer cannot find the assistant's tokens: give a template with them, "
                          "or --train-on-prompt") from None


def titles(mode: str) -> dict[str, str]:
    return {"acc_trainer": "acc_trainer", "trl": {"sft": "TRL SFTTrainer", "dpo": "TRL DPOTrainer",
                                                  "grpo": "TRL GRPOTrainer"}[mode]}


def check_grpo(cfg: TrainConfig, processes: list[int]) -> None:
    """What TRL's GRPOTrainer cannot be given as acc_trainer runs it, in one line before anything runs."""
    from ..objectives.rewards import ModelReward, reward_functions

    refuse_own_options(cfg, ONLY_ACC_TRAINER_GRPO, "bench-lm against TRL's GRPOTrainer", "TRL's logs its completions "
                       "its own way")
    if cfg.grpo_beta:
        raise ConfigError("bench-lm against TRL's GRPOTrainer: --grpo-beta needs a reference model, which TRL 1.16 "
                          "loads again from the model's hub name (create_model_from_path), and a model from a factory "
                          "has none: leave --grpo-beta at 0, TRL's default")
    if cfg.loss_type == "bnpo" and (max(processes) > 1 or cfg.grad_accum > 1):
        raise ConfigError("bench-lm against TRL's GRPOTrainer: --loss-type bnpo normalises by each process's "
                          "micro-batch in TRL, by the global batch in acc_trainer (the same on 1 process without "
                          "accumulation only): take another --loss-type, or --processes 1 and --grad-accum 1")
    functions = reward_functions(cfg.rewards or [])
    if not functions:
        raise ConfigError("bench-lm with --objective grpo needs --rewards (the same functions for both loops)")
    models = [f.name for f in functions if isinstance(f.fn, ModelReward)]
    if models:
        raise ConfigError(f"bench-lm against TRL's GRPOTrainer: {', '.join(models)} is a reward model, which TRL "
                          "tokenizes its own way: give reward functions")


def samples(cfg: TrainConfig) -> list:
    """The training samples as --dataset gives them (a factory's or files'), before any tokenization."""
    from ..config import is_data_path
    from ..data.datasets import DATASETS
    from ..data.user_data import read_files
    from ..workload.components import call_factory, import_object

    if not isinstance(cfg.dataset, str):
        raise ConfigError("bench-lm hands TRL's trainer one dataset's samples; a mixture of several is acc_trainer's only")
    if cfg.dataset in DATASETS:
        return []
    args = dict(cfg.dataset_args or {})
    made = read_files(cfg.dataset, args) if is_data_path(cfg.dataset) else call_factory(
        import_object(cfg.dataset, "--dataset"), args, {"config": cfg, "seed": cfg.seed}, f"dataset factory {cfg.dataset}")
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        return []  # a built-in set or a Data object: not text samples
    return [made[0][i] for i in range(len(made[0]))]


def workload(cfg: TrainConfig):
    """(model, train samples, tokenizer) as both loops get them: the model from its factory after seeding with
    --seed (the same weights in every loop and process), the samples from the dataset."""
    import torch

    from ..data.text import load_chat_template
    from ..workload.components import call_factory, import_object, load_tokenizer

    train = samples(cfg)
    torch.manual_seed(cfg.seed)
    model = call_factory(import_object(cfg.model, "--model"), dict(cfg.model_args or {}), {}, cfg.model)
    return model, train, load_chat_template(load_tokenizer(cfg.tokenizer), cfg.chat_template)  # the same in both


# ---------------------------------------------------------------------- the two loops


def acc_trainer_loop(cfg: TrainConfig, mode: str, steps: int, warmup: int, output_dir: str) -> tuple:
    """acc_trainer's fit() on the samples, as its command line runs it (with its allocator setting, cli.main's)."""
    from ..patches import keep_freed_memory
    from ..training.api import fit

    keep_freed_memory()
    model, train, tokenizer = workload(cfg)
    counter = Counter(model, mode, warmup, steps)
    if mode == "grpo":
        from ..objectives import grpo
        from ..objectives.sampling import completion_mask

        def sampled(seconds, made, model, prompts, keys, s, *args, **kwargs):
            if keys is not None:  # training's (evaluation's greedy completions have no keys)
                counter.generated(completion_mask(made, s.eos)[0].sum(1).tolist(), [p.tolist() for p in prompts],
                                  seconds)

        counter.timed(grpo, "generate_rows", sampled)  # --generation-groups prompts' G rows each, as GRPO calls it
        counter.timed(grpo.GRPO, "rollout", lambda seconds, *args, **kwargs: counter.rolled_out(seconds))
    run_cfg = replace(cfg, max_steps=steps, output_dir=output_dir, plots=False, progress="plain")
    summary = fit(model, train, None, tokenizer=tokenizer, config=run_cfg)
    return counter, summary["world_size"]


def trl_loop(cfg: TrainConfig, mode: str, steps: int, warmup: int, output_dir: str) -> tuple:
    """TRL's SFTTrainer, DPOTrainer or GRPOTrainer on the same samples, set up as TRL's documentation does for a model
    object, with the options above."""
    import torch
    from datasets import Dataset

    from ..workload.optim import implementation

    model, train, tokenizer = workload(cfg)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if mode == "dpo" else None  # before TRL patches it
    counter = Counter(model, mode, warmup, steps)
    tf32_as_acc_trainer(cfg)
    use_cpu = cfg.cpu or not torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    common = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=cfg.batch_size // world // cfg.grad_accum,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=cfg.max_grad_norm or 0.0,
        logging_steps=cfg.log_every, save_strategy="no", eval_strategy="no", report_to="none", seed=cfg.seed,
        use_cpu=use_cpu, ddp_backend="gloo" if use_cpu and world > 1 else None,
        dataloader_num_workers=cfg.num_workers or 0, dataloader_drop_last=True,  # acc_trainer's batches are whole
        bf16=cfg.mixed_precision == "bf16", fp16=cfg.mixed_precision == "fp16", max_length=cfg.max_length,
        gradient_checkpointing=False)  # TRL's configs turn it on by default; acc_trainer keeps the activations
    # AdamW as acc_trainer runs it: fused with --fused-optimizer (TRL's own default, adamw_torch_fused), else foreach on
    # a GPU and torch's default on a CPU (build_optimizer)
    same_adamw = None if cfg.fused_optimizer else (torch.optim.AdamW, {"lr": cfg.lr, **implementation(cfg)})
    if mode == "grpo":
        trainer = _grpo_trainer(cfg, model, train, tokenizer, common, counter)
    elif mode == "sft":
        from trl import SFTConfig, SFTTrainer

        messages = "messages" in train[0]  # prompt/completion: TRL's completion-only loss (its default) does it
        args = SFTConfig(**common, assistant_only_loss=messages and not cfg.train_on_prompt,
                         completion_only_loss=False if cfg.train_on_prompt else None, packing=False, padding_free=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(train), processing_class=tokenizer)
    else:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, beta=cfg.dpo_beta, precompute_ref_log_probs=False)
        trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(train),
                             processing_class=tokenizer)
    trainer.optimizer_cls_and_kwargs = same_adamw  # read when train() builds the optimizer (DPOTrainer takes no argument)
    trainer.train()
    return counter, trainer.args.world_size


def _grpo_trainer(cfg: TrainConfig, model, train: list, tokenizer, common: dict, counter: Counter):
    """TRL's GRPOTrainer with acc_trainer's GRPO options, generating with transformers, its sampling and rollout
    timed by `counter` (only in training: evaluation is not run)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ..objectives.rewards import reward_functions

    functions = reward_functions(cfg.rewards or [])
    args = GRPOConfig(
        **{k: v for k, v in common.items() if k != "max_length"},  # no truncation of prompts in TRL's GRPO
        num_generations=cfg.num_generations, steps_per_generation=cfg.grad_accum,  # a generation per optimizer step
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, beta=cfg.grpo_beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        num_iterations=cfg.num_iterations, scale_rewards=cfg.scale_rewards, loss_type=cfg.loss_type,
        mask_truncated_completions=cfg.mask_truncated_completions, reward_weights=[f.weight for f in functions],
        disable_dropout=True,  # acc_trainer's GRPO turns dropout off (TRL's default leaves it on)
        use_vllm=False, use_transformers_continuous_batching=False, log_completions=False)

    def sampled(seconds, result, trainer, prompt_ids, *args, **kwargs):
        if trainer.model.training:
            counter.generated([len(c) for c in result[0]], [list(p) for p in prompt_ids], seconds)

    def rolled_out(seconds, result, trainer, *args, **kwargs):
        if trainer.model.training:
            counter.rolled_out(seconds)

    counter.timed(GRPOTrainer, "_generate_single_turn", sampled)  # the step's completions, one generate() call
    counter.timed(GRPOTrainer, "_generate_and_score_completions", rolled_out)
    return GRPOTrainer(model=model, reward_funcs=[f.fn for f in functions], args=args,
                       train_dataset=Dataset.from_list(train), processing_class=tokenizer)


# ---------------------------------------------------------------------- the harness


def run_loop(loop: str, processes: int, cfg: TrainConfig, mode: str, args, folder: Path) -> dict:
    """One launch of one loop; returns its logged window (tokens, samples, seconds) and its wall time."""

    run_dir = folder / f"{mode}-{loop}-{processes}p-{time.time_ns()}"
    module = ["-m", __name__, "--loop", loop, "--mode", mode, "--steps", str(args.steps), "--warmup",
              str(args.warmup), "--output-dir", str(run_dir),
              "--config", json.dumps({k: v for k, v in cfg.to_dict().items() if v is not None})]
    started = time.perf_counter()
    result = subprocess.run(launched(processes, module), capture_output=True, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - started
    if result.returncode != 0 or "TRL_BENCH done" not in result.stdout:
        first = result.stderr.find("Traceback (most recent call last)")  # a process's own, before the launcher's
        cause = result.stderr[first:first + 3000] + "\n...\n" if 0 <= first < len(result.stderr) - 3000 else ""
        raise RuntimeError(f"{titles(mode)[loop]} on {processes} process(es) failed (exit code {result.returncode}):\n"
                           f"{cause}{result.stderr[-3000:]}")
    measured = logged_window(run_dir, args.warmup, args.steps)
    if measured["world_size"] != processes:
        raise RuntimeError(f"{titles(mode)[loop]} launched on {processes} processes ran as {measured['world_size']}")
    if mode == "grpo" and loop == "acc_trainer":
        measured["logged_generation_time_s"] = logged_generation_time(run_dir, args.warmup, cfg.log_every)
    return {**measured, "wall_s": wall, "run_dir": str(run_dir)}


def logged_generation_time(run_dir: Path, warmup: int, every: int) -> float | None:
    """acc_trainer's own `generation_time_s` (a step's rollout, the slowest process's; metrics.jsonl) averaged over the
    log intervals after the warm-up: a check of the bench's wrapper around its rollout."""
    log = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    values = [r["generation_time_s"] for r in lines if "generation_time_s" in r and r["step"] - every >= warmup]
    return statistics.mean(values) if values else None


def check_same_work(runs: dict[str, list[dict]], first_epoch: int) -> None:
    """GRPO: within each repeat, the loops on as many processes generated as many completions at every step, from the
    same prompts (as token ids) at each of the first `first_epoch` steps: after the first epoch each loop shuffles its
    own way (TRL's sampler goes on with its generator, acc_trainer's reseeds with --seed + epoch)."""
    for n in sorted({name.split("@")[1] for name in runs}):
        for a, b in zip(runs.get(f"acc_trainer@{n}", []), runs.get(f"trl@{n}", [])):
            if a["completions_by_step"] != b["completions_by_step"]:
                raise RuntimeError(f"on {n} process(es) the loops generated different numbers of completions a step: "
                                   f"{a['completions_by_step']} against {b['completions_by_step']}")
            differ = [i + 1 for i, (x, y) in enumerate(zip(a["prompts_by_step"][:first_epoch],
                                                          b["prompts_by_step"][:first_epoch])) if x != y]
            if differ:
                raise RuntimeError(f"on {n} process(es) the loops generated from different prompts at step {differ[0]} "
                                   "(tokenized differently, or dealt in another order): the prompts are in their runs' "
                                   f"bench-steps-rank<R>.jsonl ({a['run_dir']}, {b['run_dir']})")


def check_alike(runs: dict[str, list[dict]]) -> None:
    """Every run on as many processes trained alike (a comparison of different computations would mean nothing); the
    threads a process may differ between process counts (the launcher sets one a process)."""
    for n in {name.split("@")[1] for name in runs}:
        mine = {name: measured for name, measured in runs.items() if name.endswith(f"@{n}")}
        if len({json.dumps(m["setup"], sort_keys=True) for measured in mine.values() for m in measured}) != 1:
            raise RuntimeError("the loops did not train alike (precision, checkpointing, dropout, threads, optimizer):\n"
                               + "\n".join(f"{name}: {measured[0]['setup']}" for name, measured in mine.items()))


GRPO_FIGURES = ("trained_tokens_per_s", "generated_tokens_per_s", "generation_share", "rollout_share",
                "generation_s_per_step")


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per (loop, processes): the median tokens/s and samples/s over repeats; on TRL's rows acc_trainer's
    median over TRL's (`ratio`) and, repeat by repeat, acc_trainer's run over TRL's run (`ratios`, their median)."""
    rows = []
    for name, measured in runs.items():
        loop, n = name.split("@")
        speeds = [m["tokens_per_s"] for m in measured]
        rows.append({"loop": loop, "processes": int(n), "tokens_per_s": statistics.median(speeds),
                     "tokens_per_s_all": speeds, "samples_per_s": statistics.median(m["samples_per_s"] for m in measured),
                     "tokens_per_cpu_s": statistics.median(m["tokens_per_cpu_s"] for m in measured), "cpu_ratio": None,
                     "warmup_s": statistics.median(m["warmup_s"] for m in measured), "repeats": len(speeds),
                     "ratio": None, "ratios": None, "ratios_median": None,
                     **({name: statistics.median(m[name] for m in measured) for name in GRPO_FIGURES}
                        if "generation_share" in measured[0] else {})})
    ours = {r["processes"]: r for r in rows if r["loop"] == "acc_trainer"}
    for r in rows:
        mine = ours.get(r["processes"])
        if r["loop"] != "acc_trainer" and mine:
            r["ratio"] = mine["tokens_per_s"] / r["tokens_per_s"]
            r["cpu_ratio"] = mine["tokens_per_cpu_s"] / r["tokens_per_cpu_s"]
            r["ratios"] = [a / b for a, b in zip(mine["tokens_per_s_all"], r["tokens_per_s_all"], strict=True)]
            r["ratios_median"] = statistics.median(r["ratios"])
    return rows


def setup_text(setup: dict, threads: dict[int, int]) -> str:
    precision = f"autocast to {setup['autocast'].removeprefix('torch.')}" if setup["autocast"] else "float32, no autocast"
    each = ", ".join(f"{t} on {n} process(es)" for n, t in sorted(threads.items()))
    return (f"{precision}, gradient checkpointing {'on' if setup['gradient_checkpointing'] else 'off'}, dropout "
            f"{'on' if setup['dropout'] else 'off'}, threads a process: {each}, {setup['optimizer']} "
            f"({setup['implementation']}) at lr {setup['lr']:g}, weight decay {setup['weight_decay']:g}")


def markdown(rows: list[dict], cfg: TrainConfig, mode: str, args, machine: str, load: str, setup: dict,
             threads: dict[int, int], runs: dict[str, list[dict]] | None = None) -> str:
    if mode == "grpo":
        return grpo_markdown(rows, cfg, args, machine, load, setup, threads, runs or {})
    what = "labelled next tokens" if mode == "sft" else "non-padding tokens of chosen + rejected"
    per = "samples/s" if mode == "sft" else "pairs/s"
    lines = [f"# bench-lm ({'supervised fine-tuning' if mode == 'sft' else 'DPO'}): {cfg.model} on {cfg.dataset}, "
             f"global batch {cfg.batch_size}, --max-length {cfg.max_length}, {args.steps} steps ({args.warmup} of "
             f"warm-up not timed), precision {cfg.mixed_precision or 'no'}", "",
             *_how_measured(args, machine, load, setup, threads),
             f"| loop | processes | tokens/s | {per} | acc_trainer vs it | each repeat (median) | runs (tokens/s) "
             "| tokens per CPU s | acc_trainer vs it (CPU) |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    lines += [_row(r, titles(mode)[r["loop"]]) for r in rows]
    lines += ["", f"tokens/s: {what} per second over the timed steps, every process together, from each run's own "
              "step logs (bench-steps-rank<R>.jsonl). acc_trainer vs it: acc_trainer's median over this loop's, on as "
              "many processes; each repeat: acc_trainer's run over this loop's run of the same repeat. Tokens per CPU "
              "s: the same tokens over the CPU seconds of every process in the timed steps (the work itself, steadier than wall "
              "time on a shared machine; medians, and their quotient).", ""]
    return "\n".join(lines)


def _how_measured(args, machine: str, load: str, setup: dict, threads: dict[int, int]) -> list[str]:
    """The tables' preamble: the machine and its load, the repeats, and how both loops were set up."""
    return [f"Machine: {machine}; {load}. Median of {args.repeats} runs per loop, in rotating order.", "",
            f"Both loops, as read in their processes: {setup_text(setup, threads)}.", ""]


def _row(r: dict, title: str, extra: tuple = ()) -> str:
    """A loop's row of the tables: its speeds, its ratios to acc_trainer's, `extra` cells (GRPO's shares), its CPU
    figures."""
    ratio, each = _ratio_cells(r)
    cells = [title, r["processes"], f"{r['tokens_per_s']:,.0f}", f"{r['samples_per_s']:,.1f}", ratio, each,
             ", ".join(f"{s:,.0f}" for s in r["tokens_per_s_all"]), *extra, f"{r['tokens_per_cpu_s']:,.0f}",
             "-" if r["cpu_ratio"] is None else format(r["cpu_ratio"], ".3f")]
    return "| " + " | ".join(map(str, cells)) + " |"


def _ratio_cells(r: dict) -> tuple[str, str]:
    """A row's ratio to acc_trainer's median and each repeat's ratio (with their median), as the tables show them."""
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
    each = "-" if r["ratios"] is None else f"{', '.join(f'{x:.3f}' for x in r['ratios'])} ({r['ratios_median']:.3f})"
    return ratio, each


def grpo_markdown(rows: list[dict], cfg: TrainConfig, args, machine: str, load: str, setup: dict,
                  threads: dict[int, int], runs: dict[str, list[dict]]) -> str:
    lines = [f"# bench-lm (GRPO): {cfg.model} on {cfg.dataset}, rewards {', '.join(cfg.rewards or [])}, global batch "
             f"{cfg.batch_size} completions ({cfg.batch_size // cfg.num_generations} prompts x G "
             f"{cfg.num_generations}), at most {cfg.max_completion_length} tokens each, temperature {cfg.temperature:g}, "
             f"top-p {cfg.top_p:g}, top-k {cfg.top_k}, loss {cfg.loss_type}, beta {cfg.grpo_beta:g}, {args.steps} "
             f"steps ({args.warmup} of warm-up not timed), precision {cfg.mixed_precision or 'no'}", "",
             *_how_measured(args, machine, load, setup, threads),
             "| loop | processes | tokens/s (generated + trained) | completions/s | acc_trainer vs it | each repeat "
             "(median) | runs (tokens/s) | generating (share of a step) | rollout (share) | tokens per CPU s "
             "| acc_trainer vs it (CPU) |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [_row(r, titles("grpo")[r["loop"]], (f"{r['generation_share']:.1%}", f"{r['rollout_share']:.1%}"))
              for r in rows]
    logged = [m.get("logged_generation_time_s") for name, measured in runs.items() if name.startswith("acc_trainer")
              for m in measured]
    check = ""
    if logged and None not in logged:
        rollout = [m["time_s"] * m["rollout_share"] / (args.steps - args.warmup) for name, measured in runs.items()
                   if name.startswith("acc_trainer") for m in measured]
        check = (f" acc_trainer's own generation_time_s (metrics.jsonl, a step's rollout) was "
                 f"{statistics.median(logged):.4f} s a step in its runs' median, the bench's wrapper "
                 f"{statistics.median(rollout):.4f} s.")
    lines += ["", "tokens/s: the completion tokens generated (each up to and with its end-of-sequence token) plus the "
              "completion tokens the loss counts in the training forwards, per second over the timed steps, every process "
              "together, from each run's own step logs (bench-steps-rank<R>.jsonl); completions/s: the completions "
              "trained on. Generating: the share of the timed steps' seconds spent sampling (acc_trainer's "
              "generate_rows, --generation-groups prompts' G rows at a time; TRL's _generate_single_turn, its whole batch "
              "in one "
              "generate call), rollout: sampling, rewards and advantages (acc_trainer's GRPO.rollout, TRL's "
              "_generate_and_score_completions), each process's share, their mean. acc_trainer vs it: acc_trainer's "
              "median over this loop's, on as many processes; each repeat: acc_trainer's run over this loop's run of the "
              "same repeat. Tokens per CPU s: the same tokens over the CPU seconds of every process in the timed steps."
              + check, ""]
    return "\n".join(lines)


def machine_load() -> str:
    """The 1-minute load average and how many Python processes run (the bench's own included)."""
    count = subprocess.run(["pgrep", "-fc", "python"], capture_output=True, text=True).stdout.strip() or "?"
    return f"{os.getloadavg()[0]:.2f} ({count} Python processes)"


def main(args, cfg: TrainConfig, mode: str, console) -> None:
    """lm_bench.main's: every loop x process count, `args.repeats` times in rotating order; bench.json, bench.md."""

    loops = args.loops or list(LOOPS)
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown:
        data = {"sft": "chat data", "dpo": "preference pairs", "grpo": "prompts (--objective grpo)"}[mode]
        raise ConfigError(f"--loops on {data} takes {', '.join(LOOPS)}, not {','.join(loops)!r}")
    if cfg.max_length is None and mode != "grpo":  # GRPO's prompts are not cut (acc_trainer refuses longer ones)
        raise ConfigError("bench-lm on text data needs --max-length (the same truncation in both loops)")
    refuse_own_options(cfg, ONLY_ACC_TRAINER, "bench-lm against TRL", "TRL's is set up for the full model, "
                       "unpacked, eager, with AdamW from --lr")
    if mode == "grpo":
        check_grpo(cfg, args.processes)
    folder = Path(args.bench_dir or f"runs/bench-{mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, output_dir=None)
    names = [(loop, n) for n in args.processes for loop in loops]
    load = machine_load()
    console.print(f"acc-trainer bench-lm ({mode}) {cfg.model} on {cfg.dataset}, global batch "
                  f"{cfg.batch_size}, {args.steps} steps, {args.repeats} repeats: "
                  f"{', '.join(f'{k}@{n}' for k, n in names)}; load {load}", markup=False)
    runs: dict[str, list[dict]] = {f"{k}@{n}": [] for k, n in names}
    for repeat in range(args.repeats):
        for loop, n in names[repeat % len(names):] + names[: repeat % len(names)]:
            result = run_loop(loop, n, cfg, mode, args, folder / "runs")
            runs[f"{loop}@{n}"].append(result)
            console.print(f"  repeat {repeat + 1}/{args.repeats}  {loop:>11} x{n}: "
                          f"{result['tokens_per_s']:>10,.0f} tokens/s", markup=False)
    check_alike(runs)
    if mode == "grpo":
        prompts_a_step = cfg.batch_size // cfg.num_generations
        check_same_work(runs, len(samples(cfg)) // prompts_a_step * cfg.num_iterations)
    rows = summarise(runs)
    machine = machine_description()
    load = f"1-minute load average {load} at the start, {machine_load()} at the end"
    setup = next(iter(runs.values()))[0]["setup"]
    threads = {int(name.split("@")[1]): measured[0]["setup"]["threads"] for name, measured in runs.items()}
    table = markdown(rows, cfg, mode, args, machine, load, setup, threads, runs)
    report = {"mode": mode, "workload": cfg.to_dict(), "steps": args.steps, "warmup": args.warmup,
              "machine": machine, "load": load, "setup": setup, "rows": rows, "runs": runs}
    (folder / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "bench.md").write_text(table)
    console.print(table, markup=False)
    console.print(f"written: {folder / 'bench.json'}, {folder / 'bench.md'}", markup=False)


def loop_main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--loop", choices=LOOPS, required=True)
    parser.add_argument("--mode", choices=("sft", "dpo", "grpo"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--config", required=True, help="JSON of TrainConfig options for the workload")
    args = parser.parse_args()
    cfg = TrainConfig(**json.loads(args.config)).validate()
    loop = acc_trainer_loop if args.loop == "acc_trainer" else trl_loop
    counter, world = loop(cfg, args.mode, args.steps, args.warmup, args.output_dir)
    counter.write(Path(args.output_dir), int(os.environ.get("RANK", "0")))
    if os.environ.get("RANK", "0") == "0":
        print(f"TRL_BENCH done {json.dumps({'world_size': world})}", flush=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        from ..patches import leave_without_teardown

        PartialState().destroy_process_group()
        leave_without_teardown(0)  # torch 2.14's gloo may abort a finished process at exit (patches.py)


if __name__ == "__main__":
    loop_main()
