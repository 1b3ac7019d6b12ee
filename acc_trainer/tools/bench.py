"""`acc-trainer bench`: the single-vs-DDP scaling experiment, with the hand-written loops beside it.

Each variant (acc_trainer or a baseline loop, on 1 or N processes) trains the same workload for the
same number of steps with the same global batch, each in its own launch, and reports its own speed
measured over its training steps (start-up and evaluation excluded). Variants run in rotating order
within each repeat, so that a slow minute on a shared machine does not favour one of them; the
table and figures use the median over repeats.

    acc-trainer bench --model lenet --dataset fake --batch-size 128 --processes 1,2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..data.mixtures import label
from ..flags import Parser, add_training_options, config_from
from ..outputs.progress import make_console

BASELINES = ("raw", "raw-ddp", "dp", "ceiling")
PIPELINES = ("batched", "per-sample", "stream")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="acc-trainer bench",
        description="Measure acc_trainer against hand-written loops on 1 and N processes.",
    )
    parser.add_argument("--processes", default="1,2", help="process counts to run, e.g. 1,2 (default: 1,2)")
    parser.add_argument("--baselines", default="raw,raw-ddp,dp,ceiling",
                        help="raw (1 process), raw-ddp (torchrun + DistributedSampler), dp (nn.DataParallel, "
                             "2+ GPUs only), ceiling (the model and optimizer on batches already on the device, "
                             "1 process) (default: all)")
    parser.add_argument("--pipelines", default="batched",
                        help="data pipelines acc_trainer runs with: batched and/or per-sample (see --data-pipeline), "
                             "and stream (the same samples written as parquet shards and streamed by Hugging Face "
                             "datasets, which must be installed); each also gets a data-only row, its loader alone "
                             "(default: batched)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default: 60)")
    parser.add_argument("--warmup", type=int, default=10,
                        help="first steps of every variant left out of its timing (start-up, compilation, the "
                             "device's first kernels); their extra time over steady steps is reported apart; a "
                             "multiple of --log-every (default: 10)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant; the median counts (default: 5)")
    parser.add_argument("--whole-process", action="store_true",
                        help="also time each variant as a user would, as whole processes at --steps and at twice as "
                             "many (start-up cancels out): samples/s from the difference, in column 'whole process'")
    parser.add_argument("--bench-dir", help="where bench.json, bench.md and the figures go "
                                            "(default: runs/bench-<time>-<model>-<dataset>)")
    add_training_options(parser, "every option of acc-trainer --help (--model, --dataset, --batch-size, "
                                 "--mixed-precision, ...) sets the workload; --output-dir is --bench-dir")
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig]:
    args = build_parser().parse_args(argv)
    cfg = config_from(args)
    if cfg.output_dir is not None:  # each measured run gets a folder of its own: --output-dir names the bench's
        if args.bench_dir is not None:
            raise ConfigError("give the bench's folder once: --bench-dir or --output-dir, not both")
        args.bench_dir, cfg = cfg.output_dir, replace(cfg, output_dir=None)
    try:
        args.processes = sorted({int(p) for p in args.processes.split(",")})
    except ValueError:
        raise ConfigError(f"--processes takes numbers such as 1,2, not {args.processes!r}") from None
    if not args.processes or min(args.processes) < 1:
        raise ConfigError("--processes must be positive numbers")
    args.baselines = [b for b in args.baselines.split(",") if b]
    unknown = set(args.baselines) - set(BASELINES)
    if unknown:
        raise ConfigError(f"unknown baseline {sorted(unknown)[0]!r}; choose from {', '.join(BASELINES)}")
    args.pipelines = [p for p in args.pipelines.split(",") if p]
    if not args.pipelines or set(args.pipelines) - set(PIPELINES):
        raise ConfigError(f"--pipelines takes {' and/or '.join(PIPELINES)}, not {','.join(args.pipelines)!r}")
    if args.steps <= 0 or args.repeats <= 0:
        raise ConfigError("--steps and --repeats must be positive")
    if not 0 < args.warmup < args.steps or args.warmup % cfg.log_every or args.steps % cfg.log_every:
        raise ConfigError(f"--warmup and --steps must be multiples of --log-every ({cfg.log_every}) with 0 < warmup < "
                          f"steps (acc_trainer's speed is read from its log steps); got --warmup {args.warmup} "
                          f"--steps {args.steps}")
    for n in args.processes:
        if cfg.batch_size % (n * cfg.grad_accum):
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over {n} processes x {cfg.grad_accum}")
    return args, cfg


IMPLEMENTATION = {"batched": "acc_trainer", "per-sample": "acc_trainer per-sample", "stream": "acc_trainer stream"}
PIPELINE = {name: pipeline for pipeline, name in IMPLEMENTATION.items()}


def pipeline_speed(cfg: TrainConfig, pipeline: str, batches: int) -> float:
    """Samples/s of the training loader alone (its batches on the device), augmentation included."""
    import torch
    from accelerate.utils import send_to_device

    from ..data import augment
    from ..data.loaders import build_loaders
    from ..data.streams import StreamLoader
    from ..training.loop import stream_position
    from ..workload import components

    cfg = replace(cfg, data_pipeline=pipeline if pipeline != "stream" else cfg.data_pipeline)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")
    data = components.build_data(cfg)
    augmentation = augment.from_config(cfg, data)
    loader, _ = build_loaders(cfg, data, 1, device, augmentation, components.build_batching(cfg.collate, None)[0])
    done, start = 0, None
    for epoch in range(batches):
        if augmentation:
            augmentation.set_epoch(epoch)
        batches_of_epoch = loader.epoch(epoch, stream_position(epoch, 0, None)) \
            if isinstance(loader, StreamLoader) else loader
        for batch in batches_of_epoch:
            if start is None:  # the first batch starts workers: not counted
                start = time.perf_counter()
                continue
            send_to_device(batch, device, non_blocking=True)
            done += 1
            if done == batches:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                return done * (cfg.batch_size // cfg.grad_accum) / (time.perf_counter() - start)  # micro-batches
    raise ConfigError(f"the data pipeline bench needs more than {batches} batches of the training set")


# ---------------------------------------------------------------------- the stream pipeline


def write_stream(cfg: TrainConfig, folder: Path, shards: int = 4) -> TrainConfig:
    """The workload's samples as parquet shards in `folder`, and the options that stream them (`stream_data`).
    Each input is stored as its float32 bytes, as image shards store encoded images: `datasets` hands back
    nested lists of numbers 3-10x slower (700 samples/s for 3x32x32 images here, against 12,000 as bytes)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..workload import components

    data = components.build_data(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    for split, dataset in (("train", data.train), ("eval", data.eval)):
        if not hasattr(dataset, "tensors"):
            raise ConfigError("--pipelines stream writes a dataset held in memory (synthetic, fake, linear, cifar10 "
                              f"batched) as parquet shards; {cfg.dataset} is not one")
        images, y = dataset.tensors[0], dataset.tensors[1].cpu().numpy()
        prepare = getattr(dataset, "prepare", None)  # as the model takes them
        x = (prepare(images) if prepare is not None else images.float()).cpu().numpy()
        for i, part in enumerate(np.array_split(np.arange(len(x)), shards if split == "train" else 1)):
            column = pa.array([np.ascontiguousarray(row, dtype=np.float32).tobytes() for row in x[part]], pa.binary())
            pq.write_table(pa.table({"x": column, "y": pa.array(y[part])}), folder / f"{split}-{i:05d}.parquet")
    return replace(cfg, dataset=f"{__name__}:stream_data", dataset_args={"folder": str(folder), "shape": list(x.shape[1:]),
                   "num_classes": data.num_classes}, collate=None, augment="none")


class Pairs:
    """A `datasets` stream's {"x": float32 bytes, "y"} samples as (x, y) tensor pairs, its position and epochs
    passed through."""

    def __init__(self, stream, shape: list[int], num_classes: int | None):
        self.stream, self.shape, self.num_classes = stream, shape, num_classes

    def __iter__(self):
        import torch

        for sample in self.stream:
            yield torch.frombuffer(bytearray(sample["x"]), dtype=torch.float32).view(self.shape), torch.tensor(sample["y"])

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def stream_data(folder: str, shape: list[int], num_classes: int | None = None):
    """`--dataset acc_trainer.tools.bench:stream_data`: the parquet shards write_stream wrote, streamed."""
    from datasets import load_dataset

    def stream(split: str):
        files = sorted(str(p) for p in Path(folder).glob(f"{split}-*.parquet"))
        return Pairs(load_dataset("parquet", data_files=files, split="train", streaming=True), shape, num_classes)

    return stream("train"), stream("eval")


def variants(args, gpus: int) -> list[tuple[str, int]]:
    """(implementation, processes) pairs to run; DataParallel needs 2+ GPUs in one process."""
    out = []
    for n in args.processes:
        out += [(IMPLEMENTATION[p], n) for p in args.pipelines]
        if n == 1 and "raw" in args.baselines:
            out.append(("raw", 1))
        if n == 1 and "ceiling" in args.baselines:
            out.append(("ceiling", 1))
        if n > 1 and "raw-ddp" in args.baselines:
            out.append(("raw-ddp", n))
        if n > 1 and "dp" in args.baselines and gpus >= n:
            out.append(("dp", n))
    return out


def launched(processes: int, module_args: list[str]) -> list[str]:
    """The command that runs `python MODULE_ARGS` on `processes` processes (one gloo group of them on a CPU)."""
    if processes == 1:
        return [sys.executable, *module_args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--main_process_port", str(_free_port()), *module_args]


# Options that shape acc_trainer's optimizer beyond --optimizer and --lr: the loops it is compared with build
# theirs from those two (lm_bench and trl_bench refuse them with their own lists, and any weight decay).
OPTIMIZER_SHAPING = ("optimizer_args", "param_groups", "layer_decay", "no_decay_norm_bias")


def refuse_own_options(cfg: TrainConfig, names: tuple[str, ...], against: str, others: str) -> None:
    """One line naming the options of `names` that are set: each would apply to acc_trainer's loop only, so the
    loops would not compute the same thing (`against`: the bench's name for the comparison; `others`: what the
    other loops run instead)."""
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(cfg, name)]
    if given:
        raise ConfigError(f"{against}: {', '.join(given)} would apply to acc_trainer's loop only ({others}): "
                          "leave it out")


def tf32_as_acc_trainer(cfg: TrainConfig) -> None:
    """A compared loop's process set to --tf32 as acc_trainer's run sets its own (float32 matmuls and convolutions on
    TF32 tensor cores, on by default): on a GPU, the same precision in every loop; on a CPU nothing changes."""
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(cfg: TrainConfig) -> list[str]:
    """TrainConfig -> command-line flags (the ones that differ from the defaults)."""
    flags = []
    for key, value in cfg.to_dict().items():
        if value == getattr(TrainConfig, key, None) or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def run_variant(kind: str, processes: int, cfg: TrainConfig, steps: int, folder: Path, warmup: int = 0) -> dict:
    """One launch of one variant; returns its measured speed over the steps after `warmup`."""
    python = [sys.executable]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind in PIPELINE:
        cfg = replace(cfg, data_pipeline=PIPELINE[kind]) if PIPELINE[kind] != "stream" else cfg
        run_dir = folder / f"acc_trainer-{processes}p-{time.time_ns()}"
        # With the display the options ask for (default auto: plain lines into this pipe, as into a log file):
        # a user's run pays for it too.
        args = ["-m", "acc_trainer", *_options(cfg), "--max-steps", str(steps), "--output-dir", str(run_dir)]
        if processes == 1:
            cmd = python + args
        else:
            cmd = python + ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                            "--main_process_port", str(_free_port()), *args]
        started = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"acc_trainer on {processes} process(es) failed:\n{result.stderr[-3000:]}")
        return {**logged_window(run_dir, warmup, cfg.batch_size), "wall_s": wall}
    config = json.dumps({k: v for k, v in cfg.to_dict().items() if v is not None})
    args = ["-m", "acc_trainer.tools.baselines", "--loop", kind, "--steps", str(steps), "--warmup", str(warmup),
            "--config", config]
    if kind == "raw-ddp":
        cmd = python + ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                        str(_free_port()), *args]
    else:
        cmd = python + args
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("BASELINE ")), None)
    if result.returncode != 0 or line is None:
        raise RuntimeError(f"baseline {kind} on {processes} process(es) failed:\n{result.stderr[-3000:]}")
    r = json.loads(line[len("BASELINE "):])
    return {**{k: r[k] for k in ("samples_per_s", "time_s", "step_time_s", "data_time_s", "warmup_s",
                                 "peak_memory_mb")}, "wall_s": wall}


def logged_window(run_dir: Path, warmup: int, batch_size: int) -> dict:
    """An acc_trainer run's speed over the steps after `warmup`, from the intervals its metrics.jsonl logged (which
    leave out the writing of the log lines, evaluation and checkpoints): samples/s, the seconds of the timed steps,
    their step and data time (the device's wait, measure.StepGaps), the seconds a step of each logged interval, the
    seconds the warm-up steps took, and the run's model FLOPs per sample, peak memory and number of processes."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "step_time_s" in r]
    steps = [r["step"] - p["step"] for p, r in zip([{"step": 0}] + train, train)]
    timed = [(n, r) for r, n in zip(train, steps, strict=True) if r["step"] > warmup]
    done = sum(n for n, _ in timed)
    elapsed = sum(r["step_time_s"] * n for n, r in timed)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": done * batch_size / elapsed, "time_s": elapsed, "step_time_s": elapsed / done,
            "data_time_s": sum(r["data_time_s"] * n for n, r in timed) / done,
            "warmup_s": sum(r["step_time_s"] * n for r, n in zip(train, steps, strict=True) if r["step"] <= warmup),
            "interval_step_s": [r["step_time_s"] for _, r in timed],  # each logged interval's seconds a step
            "flops_per_sample": summary.get("model_flops_per_sample") or 0, "world_size": summary["world_size"],
            "peak_memory_mb": summary["peak_memory_mb"]}


def peak_flops(cfg: TrainConfig) -> tuple[float | None, str]:
    """The device's peak for MFU, and where it comes from: one GPU's data-sheet peak for the run's precision (times
    the processes, one GPU each, where the rows use it), else this machine's measured matrix-multiply rate (all of
    its cores, which the processes share)."""
    import torch

    from ..workload.measure import device_peak_flops, measured_matmul_flops, run_precision

    gpu = torch.cuda.is_available() and not cfg.cpu
    precision = run_precision(cfg.mixed_precision, cfg.tf32, "cuda" if gpu else "cpu")
    if gpu:
        peak = device_peak_flops(torch.device("cuda", 0), precision)
        name = torch.cuda.get_device_name(0)
        return peak, (f"{name}'s dense {precision} peak, {peak / 1e12:,.1f} TFLOP/s per GPU (data sheet)" if peak
                      else f"no data-sheet peak known for {name}")
    peak = measured_matmul_flops(precision)
    return peak, (f"this CPU's measured {precision} matrix-multiply rate, {peak / 1e9:,.1f} GFLOP/s (all its cores, "
                  "shared by the processes; a 1024 x 1024 product, best of 5)")


def summarise(runs: dict[str, list[dict]], names: list[tuple[str, int]], warmup: int = 0,
              peak: float | None = None, gpus: bool = False) -> list[dict]:
    """Median over repeats per variant, with speed-ups against each implementation's 1-process run, the warm-up's
    extra seconds over as many steady steps (compilation, with --compile), and MFU against `peak` (per GPU when
    `gpus`, else the machine's)."""
    rows = []
    flops = max((m.get("flops_per_sample", 0) for measured in runs.values() for m in measured), default=0)
    for kind, n in names:
        measured = runs[f"{kind}@{n}"]
        row = {"implementation": kind, "processes": n, "repeats": len(measured)}
        for key in ("samples_per_s", "time_s", "step_time_s", "data_time_s", "warmup_s"):
            row[key] = statistics.median(m[key] for m in measured)
        row["samples_per_s_all"] = [m["samples_per_s"] for m in measured]
        if "whole_samples_per_s" in measured[0]:
            row["whole_samples_per_s"] = statistics.median(m["whole_samples_per_s"] for m in measured)
        row["peak_memory_mb"] = max(m["peak_memory_mb"] for m in measured)
        row["compute_time_s"] = row["step_time_s"] - row["data_time_s"]
        row["warmup_extra_s"] = row["warmup_s"] - warmup * row["step_time_s"]
        row["mfu"] = flops * row["samples_per_s"] / (peak * (n if gpus else 1)) if flops and peak else None
        rows.append(row)
    by = {(r["implementation"], r["processes"]): r for r in rows}
    ceiling = by.get(("ceiling", 1))
    for r in rows:
        ours = r["implementation"] in PIPELINE
        single = by.get((r["implementation"], 1) if ours else ("raw", 1))
        r["speedup"] = r["samples_per_s"] / single["samples_per_s"] if single and r["implementation"] != "ceiling" else None
        r["efficiency"] = r["speedup"] / r["processes"] if r["speedup"] else None
        baseline = by.get(("raw", 1) if r["processes"] == 1 else ("raw-ddp", r["processes"]))
        r["vs_baseline"] = r["samples_per_s"] / baseline["samples_per_s"] if baseline and ours else None
        if "whole_samples_per_s" in r:
            r["whole_vs_baseline"] = (r["whole_samples_per_s"] / baseline["whole_samples_per_s"]
                                      if baseline and ours else None)
        r["vs_ceiling"] = r["samples_per_s"] / ceiling["samples_per_s"] if ceiling and r["processes"] == 1 else None
        r["data_share"] = r["data_time_s"] / r["step_time_s"]
        # The loop's own cost per step: its step beyond the ceiling's, the model and optimizer alone on batches made
        # before the clock (the loader, accumulation, losses kept, logging; in a whole process also each epoch's start
        # and evaluation, checkpoints and the display).
        timed = ceiling and r["processes"] == 1 and r["implementation"] != "ceiling"
        r["host_us"] = 1e6 * (r["step_time_s"] - ceiling["step_time_s"]) if timed else None
        if timed and "whole_samples_per_s" in r:
            batch = r["samples_per_s"] * r["step_time_s"]
            r["whole_host_us"] = 1e6 * batch * (1 / r["whole_samples_per_s"] - 1 / ceiling["whole_samples_per_s"])
    return rows


def host_cost(rows: list[dict]) -> str:
    """One line: each loop's own cost per step beyond the ceiling's (1 process), timed steps and whole processes."""
    costs = [r for r in rows if r.get("host_us") is not None]
    if not costs:
        return ""
    said = [f"{r['implementation'] if r['implementation'] in PIPELINE else 'hand-written (' + r['implementation'] + ')'} "
            f"{r['host_us']:,.0f} us" + (f" ({r['whole_host_us']:,.0f} as a whole process)" if "whole_host_us" in r else "")
            for r in costs]
    return ("Host cost per step, 1 process (the step's time beyond the ceiling's: the loop's own work, its loader "
            "included): " + ", ".join(said) + ".")


def markdown(rows: list[dict], cfg: TrainConfig, args, machine: str, pipelines: dict | None = None,
             epoch: int = 0, peak_note: str = "") -> str:
    warmup = getattr(args, "warmup", 0)
    lines = [
        f"# acc_trainer bench: {cfg.model} on {cfg.dataset}, global batch {cfg.batch_size}, {args.steps} steps "
        f"({warmup} of warm-up not timed)",
        "",
        f"Machine: {machine}. Median of {args.repeats} runs per variant, run in rotating order.",
        "",
        "| implementation | processes | train time (s) | epoch (s) | samples/s | vs hand-written | vs ceiling | speedup "
        "| scaling efficiency | data ms/step | data share | compute ms/step | warm-up extra (s) | MFU "
        "| peak memory/process (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(
            f"| {r['implementation']} | {r['processes']} | {r['time_s']:.3f} | {epoch * r['step_time_s']:.2f} | "
            f"{r['samples_per_s']:,.0f} | {fmt(r['vs_baseline'], '.3f')} | {fmt(r['vs_ceiling'], '.2f')} | "
            f"{fmt(r['speedup'], '.2f')} | {fmt(r['efficiency'], '.0%')} | {1000 * r['data_time_s']:.2f} | "
            f"{r['data_share']:.1%} | {1000 * r['compute_time_s']:.2f} | {fmt(r.get('warmup_extra_s'), '.2f')} | "
            f"{fmt(r.get('mfu'), '.1%')} | {r['peak_memory_mb']:,.0f} |")
    lines += ["", f"Every figure but the warm-up's is over the steps after the first {warmup} (the same for every "
              "variant). vs hand-written: acc_trainer's samples/s over the raw single-process loop (1 process) or the "
              "raw torchrun + DistributedSampler loop (N processes). vs ceiling: over the model and optimizer "
              "stepping on batches already on the device (no loader, logging or evaluation; the trainer's allocator, "
              "TF32, precision, memory format and optimizer). Speedup and efficiency: against the same implementation "
              "on 1 process. Data ms/step: how long the device waited between steps (on a GPU from CUDA events, not "
              f"the host's clock). Warm-up extra: the {warmup} warm-up steps' seconds beyond as many steady steps "
              "(with --compile, the compilation). MFU: model FLOPs per sample (acc_trainer's count, the same model "
              f"in every row) x samples/s over {peak_note or 'the peak'}. Epoch: step time x {epoch} steps of a "
              f"{cfg.batch_size}-sample batch.", ""]
    if host_cost(rows):
        lines += [host_cost(rows), ""]
    if "whole_samples_per_s" in rows[0]:
        lines += [f"Whole process, as a user times it: each variant run at {args.steps} and at {2 * args.steps} steps, "
                  "samples/s from the difference of the two wall times (start-up, imports and the first "
                  "evaluation cancel out; everything a step costs, logging included, counts).", "",
                  "| implementation | processes | whole-process samples/s | vs hand-written |", "| --- | ---: | ---: | ---: |"]
        for r in rows:
            ratio = "-" if r.get("whole_vs_baseline") is None else f"{r['whole_vs_baseline']:.3f}"
            lines.append(f"| {r['implementation']} | {r['processes']} | {r['whole_samples_per_s']:,.0f} | {ratio} |")
        lines.append("")
    if pipelines:
        against = "per-sample" if "per-sample" in pipelines else "batched"  # a stream against the samples in memory
        lines += [f"| data pipeline (loader alone, 1 process) | samples/s | vs {against} |", "| --- | ---: | ---: |"]
        for name, speed in pipelines.items():
            base = pipelines.get(against)
            lines.append(f"| {name} | {speed:,.0f} | {speed / base:.2g}x |" if base else f"| {name} | {speed:,.0f} | - |")
        lines.append("")
    return "\n".join(lines)


def machine_description() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{os.cpu_count()} CPU cores, no GPU, torch {torch.__version__}"


def main(argv: list[str]) -> None:
    args, cfg = parse(argv)
    import torch  # after the options are checked: a mistake is answered at once

    console = make_console()
    gpus = torch.cuda.device_count()
    names = variants(args, gpus)
    generated = cfg.dataset in ("synthetic", "linear", "fake")
    if not generated:
        from ..workload.components import build_data
    per_epoch = max(1, (cfg.train_size if generated else len(build_data(cfg).train)) // cfg.batch_size)
    # Enough epochs for --steps; a small evaluation set (evaluation is not measured anyway).
    cfg.epochs = math.ceil(args.steps / per_epoch)
    cfg.eval_size = min(cfg.eval_size, cfg.batch_size)
    folder = Path(args.bench_dir or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}-{cfg.model}-{label(cfg.dataset)}")
    folder.mkdir(parents=True, exist_ok=True)
    streamed = write_stream(cfg, folder / "parquet") if "stream" in args.pipelines else None  # the same samples
    console.print(f"[bold]acc-trainer bench[/] {cfg.model} on {cfg.dataset}, global batch {cfg.batch_size}, "
                  f"{args.steps} steps, {args.repeats} repeats: {', '.join(f'{k}@{n}' for k, n in names)}")
    if "dp" in args.baselines and gpus < 2:
        console.print("dp (nn.DataParallel) needs 2+ GPUs: not run on this machine")
    runs: dict[str, list[dict]] = {f"{k}@{n}": [] for k, n in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for kind, n in order:
            workload = streamed if kind == IMPLEMENTATION["stream"] else cfg
            result = run_variant(kind, n, workload, args.steps, folder / "runs", args.warmup)
            if args.whole_process:  # the same variant at twice the steps: the difference is steps, not start-up
                longer = run_variant(kind, n, workload, 2 * args.steps, folder / "runs", args.warmup)
                result["whole_samples_per_s"] = args.steps * cfg.batch_size / max(longer["wall_s"] - result["wall_s"],
                                                                                   1e-9)
            runs[f"{kind}@{n}"].append(result)
            console.print(f"  repeat {repeat + 1}/{args.repeats}  {kind:>11} x{n}: {result['samples_per_s']:>10,.0f} samples/s")
    peak, peak_note = peak_flops(cfg)
    rows = summarise(runs, names, args.warmup, peak, gpus=torch.cuda.is_available() and not cfg.cpu)
    pipelines = {}
    if len(args.pipelines) > 1:  # the loaders alone, median of the repeats
        for pipeline in args.pipelines:
            pipelines[pipeline] = statistics.median(pipeline_speed(streamed if pipeline == "stream" else cfg, pipeline,
                                                                   args.steps) for _ in range(args.repeats))
            console.print(f"  data pipeline {pipeline:>10}: {pipelines[pipeline]:>10,.0f} samples/s")
    machine = machine_description()
    report = {"workload": cfg.to_dict(), "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "machine": machine, "peak_flops": peak, "peak": peak_note, "rows": rows, "pipelines": pipelines,
              "runs": runs}
    (folder / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(rows, cfg, args, machine, pipelines, per_epoch, peak_note)
    (folder / "bench.md").write_text(table)
    from .figures import plot_bench

    figures = plot_bench(rows, folder, f"{cfg.model} on {cfg.dataset}, global batch {cfg.batch_size}")
    console.print(table)
    console.print(f"written: {folder / 'bench.json'}, {folder / 'bench.md'}, " + ", ".join(str(f) for f in figures))
