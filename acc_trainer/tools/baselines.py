"""The hand-written loops acc_trainer replaces, for `acc-trainer bench` to measure it against.

Written plainly, as the DDP tutorials write them: a DataLoader with shuffle (one sample per
__getitem__), zero_grad / forward / backward / step, with autocast (and a grad scaler for fp16),
channels-last and torch.compile when the options ask for them. `raw`: one process. `raw-ddp`: torch
DDP with a DistributedSampler, one process per device, started by torchrun. `dp`: nn.DataParallel
over all GPUs of one process. `ceiling`: no loader at all, the same model and optimizer stepping on
a few batches already on the device, with acc_trainer's allocator setting: the compute limit. They
train the same model on the same data (acc_trainer's own builders) for the same number of steps, and
print one JSON line with their speed.

    python -m acc_trainer.tools.baselines --loop raw --steps 50 --warmup 10 --config '{"model": "lenet", "dataset": "fake"}'
    torchrun --nproc_per_node 2 -m acc_trainer.tools.baselines --loop raw-ddp --steps 50 --warmup 10 --config '...'

(the workload as TrainConfig options in JSON; prints one `BASELINE {...}` line with its speed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ..config import TrainConfig
from ..data.datasets import InMemory, PerSample
from ..patches import keep_freed_memory
from ..workload.components import build_data, build_model
from ..workload.measure import StepGaps, peak_memory_mb
from ..workload.models import compile_blocks
from ..workload.optim import build_optimizer


def run(loop: str, cfg: TrainConfig, steps: int, warmup: int = 0) -> dict:
    """Trains with hand-written loop `loop` for `steps` steps, the first `warmup` of them not timed; its speed (the
    main process's; {} on the others)."""
    ddp = loop == "raw-ddp"
    if loop == "ceiling":  # the hand-written loops run without it, as a user's would
        keep_freed_memory()
    rank, world = join_processes(ddp)
    device = prepare_device(cfg)
    torch.manual_seed(cfg.seed)
    data = build_data(cfg)
    model = wrap_model(build_model(cfg, data).to(device), loop, cfg, device)
    # The trainer's optimizer implementation in every loop (fused with --fused-optimizer, else torch's default as a
    # tutorial's loop gets it: foreach on a GPU, its loop over parameters on a CPU).
    optimizer = build_optimizer(cfg, model.parameters(), cfg.lr, fused=cfg.fused_optimizer)
    if loop == "ceiling":
        batches = batches_on_device(data.train, cfg, device, steps)
    else:
        batches = batches_from_loader(data.train, cfg, device, steps, ddp, world)
    elapsed, data_time, warmup_s = time_steps(model, optimizer, batches, data.task, cfg, device, steps, warmup)
    timed = steps - warmup
    result = {"loop": loop, "world_size": world, "steps": steps, "warmup": warmup, "time_s": elapsed,
              "samples_per_s": timed * cfg.batch_size / elapsed, "step_time_s": elapsed / timed,
              "data_time_s": data_time / timed, "warmup_s": warmup_s, "peak_memory_mb": peak_memory_mb(device)}
    if ddp:
        dist.destroy_process_group()
    return result if rank == 0 else {}


def join_processes(ddp: bool) -> tuple[int, int]:
    """This process's rank and the number of processes (the process group started for `raw-ddp`)."""
    if ddp:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def prepare_device(cfg: TrainConfig) -> torch.device:
    """This process's device (its LOCAL_RANK's GPU, else the CPU), made current, with --tf32 applied."""
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    return device


def wrap_model(model: torch.nn.Module, loop: str, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The model channels-last and compiled as the options ask (as acc_trainer compiles it: a model of repeated
    blocks block by block in place, any other whole; whole under DataParallel), in DDP or DataParallel as the loop
    has it."""
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # DataParallel's replicas copy a block compiled in place with the original's weights in it: compiled whole there.
    if cfg.compile and (loop == "dp" or not compile_blocks(model)):
        model = torch.compile(model)
    if loop == "raw-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None else None)
    elif loop == "dp":
        model = torch.nn.DataParallel(model)
    return model


def batches_on_device(train, cfg: TrainConfig, device: torch.device, steps: int):
    """A few batches already on the device, over and over: what the model and optimizer alone can do. Made here,
    before the clock starts (timed, their making was 9.6 ms of the 114 ms step of a ResNet-18 at 224x224 on an H100:
    the ceiling then ran slower than acc_trainer)."""
    return itertools.cycle([_to(b, device, cfg.channels_last) for b in first_batches(train, cfg.batch_size, min(steps, 4))])


def batches_from_loader(train, cfg: TrainConfig, device: torch.device, steps: int, ddp: bool, world: int):
    """One sample per __getitem__, collated by the DataLoader, as the hand-written loops have it."""
    if isinstance(train, InMemory):
        plain = TensorDataset(*train.tensors)
        train = PerSample(plain, train.prepare) if train.prepare else plain
    sampler = DistributedSampler(train, shuffle=True, drop_last=True) if ddp else None
    loader = DataLoader(train, batch_size=cfg.batch_size // world, shuffle=sampler is None, sampler=sampler,
                        drop_last=True, num_workers=cfg.num_workers or 0, pin_memory=device.type == "cuda",
                        persistent_workers=bool(cfg.num_workers))
    for epoch in range(steps):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            yield _to(batch, device, cfg.channels_last)


def time_steps(model, optimizer, batches, task: str, cfg: TrainConfig, device: torch.device, steps: int,
               warmup: int = 0) -> tuple[float, float, float]:
    """`steps` training steps on `batches`: the seconds of those after the first `warmup`, the part of them the
    device waited for a batch (measure.StepGaps, as the trainer measures it), and the seconds the warm-up took."""
    precision = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision or "no")
    scaler = torch.amp.GradScaler(device.type) if precision == torch.float16 else None
    loss_fn = F.cross_entropy if task == "classification" else F.mse_loss
    gaps, done, warmup_s = StepGaps(device), 0, 0.0
    start = ready = time.perf_counter()  # the batches may be generators: making the first ones is timed too
    for inputs, targets in batches:
        gaps.began(time.perf_counter() - ready)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=precision, enabled=precision is not None):
            loss = loss_fn(model(inputs).float(), targets)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        gaps.ended()
        done += 1
        if done == warmup:  # the device done with the warm-up: the timed steps start now
            loss.item()
            gaps.read()
            gaps.forget()
            warmup_s, start = time.perf_counter() - start, time.perf_counter()
        ready = time.perf_counter()
        if done == steps:
            break
    loss.item()  # waits for the device, as the end of any real loop does
    return time.perf_counter() - start, gaps.read(), warmup_s


def first_batches(dataset, batch_size: int, count: int) -> list:
    """`count` batches of the dataset's first samples, collated (not timed)."""
    if isinstance(dataset, InMemory):
        return [dataset.__getitems__(range(i * batch_size, (i + 1) * batch_size)) for i in range(count)]
    loader = DataLoader(dataset, batch_size=batch_size, drop_last=True)
    return [b for b, _ in zip(loader, range(count))]


def _to(batch, device: torch.device, channels_last: bool):
    inputs, targets = batch
    inputs = inputs.to(device, non_blocking=True)
    if channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets.to(device, non_blocking=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m acc_trainer.tools.baselines")
    parser.add_argument("--loop", choices=("raw", "raw-ddp", "dp", "ceiling"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=0, help="first steps not timed (default: 0)")
    parser.add_argument("--config", required=True, help="JSON of TrainConfig options for the workload")
    args = parser.parse_args()
    cfg = TrainConfig(**json.loads(args.config)).validate()
    result = run(args.loop, cfg, args.steps, args.warmup)
    if result:
        print("BASELINE " + json.dumps(result), flush=True)
    if args.loop == "raw-ddp":
        # torch 2.14's gloo sometimes aborts a finished multi-process script at interpreter exit ("terminate
        # called without an active exception", SIGABRT; about 1 run in 13 on a CPU), after the process group
        # is destroyed and the result printed: leave without the interpreter's teardown, so that the bench
        # reports the loop's speed, not that.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
