"""`acc-trainer bench-lm`: acc_trainer against what a language-model user would pick instead, the Hugging Face
Trainer and a plain Accelerate loop, on the same causal language model and token blocks.

The workload is acc_trainer's own options (a YAML such as examples/stdlib_lm_bench.yaml): a transformers
causal LM and a dataset of equal-length blocks of {"input_ids", "labels"}, so that every loop feeds the model
batches of one shape without a collate function of its own. Each loop trains it for `--steps` optimizer steps
with the same global batch, process count, AdamW, constant learning rate, clipping and precision, logging its
loss every `--log-every` steps, in a launch of its own (`accelerate launch --multi_gpu` for several processes),
in rotating order within each repeat. Speed counts only the steps after `--warmup`, as wall time between
optimizer steps: acc_trainer's from its metrics.jsonl (the intervals after the warm-up, which leave out the
writing of its log lines), the Trainer's from a callback at each step's end, the plain loop's from its own clock.
Tokens are the labelled next tokens the loss counts (a block of L tokens predicts L - 1). The table gives the
median over repeats and acc_trainer's ratios to the two others (quotients of those medians).

    cd examples && acc-trainer bench-lm --config stdlib_lm_bench.yaml --processes 1,2 --repeats 3

On text data (chat messages, prompt/completion) or with --objective dpo or grpo, the command measures acc_trainer
against TRL's SFTTrainer, DPOTrainer or GRPOTrainer instead (trl_bench.py).

The loops also run on their own: `python -m acc_trainer.tools.lm_bench --loop hf_trainer|accelerate --steps N
--warmup W --config '{...}'` (under `accelerate launch` for several processes) prints one `LM_BENCH {...}` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError, TrainConfig, load_yaml, make_config
from ..flags import Parser, add_training_options
from .bench import (
    OPTIMIZER_SHAPING,
    _options,
    launched,
    logged_window,
    machine_description,
    peak_flops,
    refuse_own_options,
    tf32_as_acc_trainer,
)

LOOPS = ("acc_trainer", "hf_trainer", "accelerate")
# Options the two other loops do not apply: with any of them the loops would not compute the same thing.
ONLY_ACC_TRAINER = ("lora", "pack", "ema", "freeze", "init_from", "label_smoothing", "gradient_checkpointing",
                    *OPTIMIZER_SHAPING)
TITLES = {"acc_trainer": "acc_trainer", "hf_trainer": "Hugging Face Trainer", "accelerate": "plain Accelerate loop"}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="acc-trainer bench-lm",
                    description="Tokens per second of acc_trainer, the Hugging Face Trainer and a plain Accelerate loop "
                                "on one causal language model.")
    parser.add_argument("--processes", default="1,2", help="process counts to run, e.g. 1,2 (default: 1,2)")
    parser.add_argument("--loops", help=f"loops to run (default: {','.join(LOOPS)}; on chat data or with --objective "
                                        "dpo or grpo: acc_trainer,trl, TRL's SFTTrainer, DPOTrainer or GRPOTrainer: "
                                        "trl_bench.py)")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run (default: 25)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (default: 5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop; the median counts (default: 3)")
    parser.add_argument("--bench-dir", help="where bench.json and bench.md go (default: runs/bench-lm-<time>)")
    add_training_options(parser, "every option of acc-trainer --help sets the workload (--config, --model, --dataset, "
                                 "--batch-size, --lr, --max-grad-norm, --mixed-precision, --log-every, ...)")
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig]:
    args = build_parser().parse_args(argv)
    values = vars(args)
    given = {name: values[name] for name in TrainConfig.__dataclass_fields__ if name in values}
    cfg = make_config({**(load_yaml(values["config"]) if "config" in values else {}), **given})
    try:
        args.processes = sorted({int(p) for p in args.processes.split(",")})
    except ValueError:
        raise ConfigError(f"--processes takes numbers such as 1,2, not {args.processes!r}") from None
    args.loops = [name for name in (args.loops or "").split(",") if name]  # checked by the mode's main
    if not args.processes or min(args.processes) < 1 or args.repeats < 1:
        raise ConfigError("--processes and --repeats must be positive")
    if not 0 < args.warmup < args.steps or args.warmup % cfg.log_every or args.steps % cfg.log_every:
        raise ConfigError(f"--warmup and --steps must be multiples of --log-every ({cfg.log_every}), 0 < warmup < steps")
    # What the three loops can all do, the same way (each is written in a few lines below).
    if cfg.optimizer != "adamw" or cfg.scheduler != "constant" or cfg.warmup_steps or cfg.scale_lr:
        raise ConfigError("bench-lm compares the loops with --optimizer adamw, --scheduler constant, no warm-up "
                          "and no --scale-lr")
    if cfg.weight_decay:  # the loops would decay different parameters
        raise ConfigError("bench-lm compares the loops without weight decay: the Hugging Face Trainer and TRL leave "
                          "biases and normalisation weights undecayed, a plain loop decays every parameter")
    for n in args.processes:
        if cfg.batch_size % (n * cfg.grad_accum):
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over {n} processes x {cfg.grad_accum}")
    return args, cfg


def tokens_per_sample(cfg: TrainConfig, train) -> int:
    """Every training sample's count of labelled next tokens; the bench needs blocks that all have the same."""
    from ..workload.losses import count_next_tokens

    first = train[0] if hasattr(train, "__getitem__") else None
    if not (isinstance(first, dict) and {"input_ids", "labels"} <= set(first)):
        raise ConfigError(f"bench-lm needs a dataset of {{'input_ids', 'labels'}} blocks; {cfg.dataset} gives "
                          f"{type(first).__name__} samples")
    counts = {int(count_next_tokens(train[i]["labels"])) for i in range(len(train))}
    shapes = {tuple(train[i]["input_ids"].shape) for i in range(len(train))}
    if len(counts) != 1 or len(shapes) != 1:
        raise ConfigError(f"bench-lm needs blocks of one length with the same labelled tokens; {cfg.dataset} has "
                          f"{len(shapes)} lengths and {len(counts)} token counts")
    return counts.pop()


# ---------------------------------------------------------------------- one launch of one loop


def run_loop(loop: str, processes: int, cfg: TrainConfig, args, folder: Path) -> dict:
    """One launch; returns {"samples_per_s", "time_s", "wall_s"} over the steps after the warm-up."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run_dir = folder / f"{loop}-{processes}p-{time.time_ns()}"
    if loop == "acc_trainer":
        module = ["-m", "acc_trainer", *_options(cfg), "--max-steps", str(args.steps), "--output-dir", str(run_dir),
                  "--no-plots"]
    else:
        module = ["-m", __name__, "--loop", loop, "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--output-dir", str(run_dir), "--config", json.dumps({k: v for k, v in cfg.to_dict().items()
                                                                        if v is not None})]
    started = time.perf_counter()
    result = subprocess.run(launched(processes, module), capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("LM_BENCH ")), None)
    if result.returncode != 0 or (loop != "acc_trainer" and line is None):
        raise RuntimeError(f"{TITLES[loop]} on {processes} process(es) failed:\n{result.stderr[-3000:]}")
    measured = logged_window(run_dir, args.warmup, cfg.batch_size) if loop == "acc_trainer" \
        else json.loads(line[len("LM_BENCH "):])
    if measured["world_size"] != processes:  # copies training alone would each do the whole batch
        raise RuntimeError(f"{TITLES[loop]} launched on {processes} processes ran as {measured['world_size']}")
    return {**measured, "wall_s": wall}


# ---------------------------------------------------------------------- the two other loops


def _seconds_between(clock: dict, warmup: int, steps: int, batch_size: int, every: int) -> dict:
    """Speed over the steps after the warm-up, the seconds a step of each `every` steps after it (the intervals
    acc_trainer logs), and the warm-up's seconds (from the first step's start)."""
    elapsed = clock[steps] - clock[warmup]
    read = sorted(k for k in clock if k >= warmup)
    return {"samples_per_s": (steps - warmup) * batch_size / elapsed, "time_s": elapsed,
            "interval_step_s": [(clock[b] - clock[a]) / (b - a) for a, b in zip(read, read[1:])],
            "warmup_s": clock[warmup] - clock[0]}


def _stamped(step: int, warmup: int, steps: int, every: int) -> bool:
    """Whether the clock is read at the end of optimizer step `step`: the warm-up's end, every `every` steps after
    it, and the last step."""
    return step == steps or step >= warmup and (step - warmup) % every == 0


def hf_trainer(cfg: TrainConfig, steps: int, warmup: int, output_dir: str) -> dict:
    """The Hugging Face Trainer as its documentation sets it up for a causal LM, with the workload's options."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ..workload.components import build_data, build_model

    tf32_as_acc_trainer(cfg)
    use_cpu = cfg.cpu or not torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    training = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=cfg.batch_size // world // cfg.grad_accum,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
        lr_scheduler_type="constant", max_grad_norm=cfg.max_grad_norm or 0.0, logging_steps=cfg.log_every,
        save_strategy="no", eval_strategy="no", report_to="none", seed=cfg.seed, use_cpu=use_cpu,
        ddp_backend="gloo" if use_cpu and world > 1 else None, dataloader_num_workers=cfg.num_workers or 0,
        bf16=cfg.mixed_precision == "bf16", fp16=cfg.mixed_precision == "fp16", torch_compile=cfg.compile)
    clock = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if _stamped(state.global_step, warmup, steps, cfg.log_every):
                if torch.cuda.is_available() and not use_cpu:
                    torch.cuda.synchronize()
                clock[state.global_step] = time.perf_counter()

    torch.manual_seed(cfg.seed)  # acc_trainer's and the plain loop's models start from the same weights
    data = build_data(cfg)
    trainer = Trainer(model=build_model(cfg, data), args=training, train_dataset=data.train, callbacks=[Clock()])
    trainer.train()
    return {**_seconds_between(clock, warmup, steps, cfg.batch_size, cfg.log_every), "world_size": trainer.args.world_size}


def accelerate_loop(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    """A plain Accelerate loop, as Accelerate's `examples/complete_nlp_example.py` writes it (with clipping and
    a loss line every --log-every steps); with --compile, Accelerate's regional compilation, as its docs advise for
    transformers models."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin
    from torch.utils.data import DataLoader

    from ..workload.components import build_data, build_model

    # cpu=True without a GPU, as Accelerate's CPU examples pass it: else processes started by `accelerate launch
    # --multi_gpu` on a CPU each train alone instead of forming a gloo group.
    tf32_as_acc_trainer(cfg)
    accelerator = Accelerator(cpu=cfg.cpu or not torch.cuda.is_available(), mixed_precision=cfg.mixed_precision,
                              gradient_accumulation_steps=cfg.grad_accum,
                              dynamo_plugin=TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
                              if cfg.compile else None)
    torch.manual_seed(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg, data)
    per_process = cfg.batch_size // accelerator.num_processes // cfg.grad_accum
    loader = DataLoader(data.train, batch_size=per_process, shuffle=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    step, clock = 0, {0: time.perf_counter()}
    while step < steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % cfg.log_every == 0:
                accelerator.print(f"step {step} loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}")
            if _stamped(step, warmup, steps, cfg.log_every):
                if accelerator.device.type == "cuda":
                    torch.cuda.synchronize()
                clock[step] = time.perf_counter()
            if step == steps:
                break
    return {**_seconds_between(clock, warmup, steps, cfg.batch_size, cfg.log_every),
            "world_size": accelerator.num_processes}


# ---------------------------------------------------------------------- the command


def summarise(runs: dict[str, list[dict]], tokens: int, warmup: int = 0, steps: int = 1, peak: float | None = None,
              gpus: bool = False, batch_size: int = 1) -> list[dict]:
    """One row per (loop, processes): median tokens/s; the warm-up's seconds beyond as many steady steps (with
    --compile, the compilation); MFU from acc_trainer's model FLOPs per sample (the same model in every loop) over
    `peak` (per GPU when `gpus`); on the other loops' rows, acc_trainer's median over theirs (`ratio`) and, repeat by
    repeat, acc_trainer's run over theirs (`ratios`: the runs of one repeat follow each other, so a busy minute on a
    shared machine touches both alike) with their median. `quiet_tokens_per_s`: the speed of the lower quartile of
    the seconds a step over every repeat's timed intervals of --log-every steps (on a shared machine other work
    only ever adds time, in phases of several seconds that a run of one loop may meet all along and the next not at
    all: the quiet intervals are each loop's own speed), with acc_trainer's over it (`quiet_ratio`)."""
    rows = []
    flops = max((m.get("flops_per_sample", 0) for measured in runs.values() for m in measured), default=0)
    for name, measured in runs.items():
        loop, n = name.split("@")
        speeds = [m["samples_per_s"] * tokens for m in measured]
        step_s = statistics.median(m["time_s"] for m in measured) / (steps - warmup)
        row = {"loop": loop, "processes": int(n), "tokens_per_s": statistics.median(speeds),
               "tokens_per_s_all": speeds, "repeats": len(speeds), "ratio": None, "ratios": None,
               "warmup_s": statistics.median(m["warmup_s"] for m in measured)}
        row["warmup_extra_s"] = row["warmup_s"] - warmup * step_s
        samples_per_s = statistics.median(m["samples_per_s"] for m in measured)
        row["mfu"] = flops * samples_per_s / (peak * (int(n) if gpus else 1)) if flops and peak else None
        row["quiet_tokens_per_s"] = batch_size * tokens / quiet(m["interval_step_s"] for m in measured)
        rows.append(row)
    ours = {r["processes"]: r for r in rows if r["loop"] == "acc_trainer"}
    for r in rows:
        mine = ours.get(r["processes"])
        if r["loop"] != "acc_trainer" and mine:
            r["ratio"] = mine["tokens_per_s"] / r["tokens_per_s"]
            r["ratios"] = [a / b for a, b in zip(mine["tokens_per_s_all"], r["tokens_per_s_all"], strict=True)]
            r["ratios_median"] = statistics.median(r["ratios"])
            r["quiet_ratio"] = mine["quiet_tokens_per_s"] / r["quiet_tokens_per_s"]
    return rows


def quiet(intervals) -> float:
    """Every run's seconds a step, interval by interval, pooled and sorted: the one at index n // 4 (of 20
    intervals the 6th fastest; of 2, the faster), a lower quartile."""
    pooled = sorted(t for run in intervals for t in run)
    return pooled[len(pooled) // 4]


def markdown(rows: list[dict], cfg: TrainConfig, args, tokens: int, machine: str, peak_note: str = "") -> str:
    lines = [f"# bench-lm: {cfg.model} on {cfg.dataset}, global batch {cfg.batch_size} x {tokens + 1} tokens, "
             f"{args.steps} steps ({args.warmup} of warm-up not timed), precision {cfg.mixed_precision or 'no'}"
             + (", compiled" if cfg.compile else ""),
             "", f"Machine: {machine}. Median of {args.repeats} runs per loop, in rotating order.", "",
             "| loop | processes | tokens/s | MFU | warm-up extra (s) | acc_trainer vs it | each repeat (median) "
             "| quiet tokens/s | acc_trainer vs it, quiet | runs (tokens/s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        each = "-" if r["ratios"] is None else \
            f"{', '.join(f'{x:.3f}' for x in r['ratios'])} ({r['ratios_median']:.3f})"
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        quiet_ratio = "-" if r.get("quiet_ratio") is None else f"{r['quiet_ratio']:.3f}"
        lines.append(f"| {TITLES[r['loop']]} | {r['processes']} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['warmup_extra_s']:.2f} | {ratio} | {each} | {r['quiet_tokens_per_s']:,.0f} | {quiet_ratio} | "
                     f"{', '.join(f'{s:,.0f}' for s in r['tokens_per_s_all'])} |")
    lines += ["", "tokens/s: labelled next tokens per second over the timed steps (global, every process together). "
              f"MFU: model FLOPs per sample (acc_trainer's count) x samples/s over {peak_note or 'the peak'}. Warm-up "
              f"extra: the {args.warmup} warm-up steps' seconds beyond as many steady steps (with --compile, the "
              "compilation). acc_trainer vs it: acc_trainer's median over this loop's, on as many processes; each "
              "repeat: acc_trainer's run over this loop's run of the same repeat. Quiet: at the lower quartile of the "
              f"seconds a step of every run's intervals of {cfg.log_every} steps (the machine's other work only adds "
              "time).", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    args, cfg = parse(argv)
    from ..outputs.progress import make_console
    from ..workload.components import build_data
    from . import trl_bench

    console = make_console()
    mode = trl_bench.mode_of(cfg)
    if mode is not None:  # chat data or preference pairs: against TRL's trainers (with their own list of refusals)
        return trl_bench.main(args, cfg, mode, console)
    refuse_own_options(cfg, ONLY_ACC_TRAINER, "bench-lm", "the Hugging Face Trainer and the plain loop train the full "
                       "model as built, with AdamW from --lr")
    args.loops = args.loops or list(LOOPS)
    unknown = sorted(set(args.loops) - set(LOOPS))
    if unknown:
        raise ConfigError(f"--loops takes {', '.join(LOOPS)}, not {','.join(args.loops)!r}")
    tokens = tokens_per_sample(cfg, build_data(cfg).train)
    folder = Path(args.bench_dir or f"runs/bench-lm-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, output_dir=None)
    names = [(loop, n) for n in args.processes for loop in args.loops]
    console.print(f"[bold]acc-trainer bench-lm[/] {cfg.model} on {cfg.dataset}, global batch {cfg.batch_size}, "
                  f"{args.steps} steps, {args.repeats} repeats: {', '.join(f'{k}@{n}' for k, n in names)}")
    runs: dict[str, list[dict]] = {f"{k}@{n}": [] for k, n in names}
    for repeat in range(args.repeats):
        for loop, n in names[repeat % len(names):] + names[: repeat % len(names)]:
            result = run_loop(loop, n, cfg, args, folder / "runs")
            runs[f"{loop}@{n}"].append(result)
            console.print(f"  repeat {repeat + 1}/{args.repeats}  {loop:>11} x{n}: "
                          f"{result['samples_per_s'] * tokens:>10,.0f} tokens/s", markup=False)
    import torch

    peak, peak_note = peak_flops(cfg)
    rows = summarise(runs, tokens, args.warmup, args.steps, peak, gpus=torch.cuda.is_available() and not cfg.cpu,
                     batch_size=cfg.batch_size)
    machine = machine_description()
    table = markdown(rows, cfg, args, tokens, machine, peak_note)
    report = {"workload": cfg.to_dict(), "steps": args.steps, "warmup": args.warmup, "tokens_per_sample": tokens,
              "machine": machine, "peak_flops": peak, "peak": peak_note, "rows": rows, "runs": runs}
    (folder / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "bench.md").write_text(table)
    console.print(table, markup=False)
    console.print(f"written: {folder / 'bench.json'}, {folder / 'bench.md'}", markup=False)


def loop_main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--loop", choices=LOOPS[1:], required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir (it writes nothing there)")
    parser.add_argument("--config", required=True, help="JSON of TrainConfig options for the workload")
    args = parser.parse_args()
    cfg = TrainConfig(**json.loads(args.config)).validate()
    result = hf_trainer(cfg, args.steps, args.warmup, args.output_dir) if args.loop == "hf_trainer" \
        else accelerate_loop(cfg, args.steps, args.warmup)
    if os.environ.get("RANK", "0") == "0":
        print("LM_BENCH " + json.dumps(result), flush=True)
    if os.environ.get("WORLD_SIZE", "1") != "1":
        # torch 2.14's gloo now and then aborts a finished multi-process script at interpreter exit (SIGABRT), after
        # the result is printed: leave without the interpreter's teardown (as baselines.py and the CLI do).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    loop_main()
