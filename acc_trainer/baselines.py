"""The hand-written loops acc_trainer replaces, for `acc-trainer bench` to measure it against.

Written plainly, as the DDP tutorials write them: a DataLoader with shuffle, zero_grad / forward /
backward / step. `raw`: one process. `raw-ddp`: torch DDP with a DistributedSampler, one process per
device, started by torchrun. `dp`: nn.DataParallel over all GPUs of one process. They train the
same model on the same data (acc_trainer's own builders) for the same number of steps, and print
one JSON line with their speed.

    python -m acc_trainer.baselines --loop raw --model lenet --dataset fake --batch-size 128 --steps 50
    torchrun --nproc_per_node 2 -m acc_trainer.baselines --loop raw-ddp ...
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .components import build_data, build_model
from .config import TrainConfig
from .metrics import peak_memory_mb
from .optim import build_optimizer


def run(loop: str, cfg: TrainConfig, steps: int) -> dict:
    ddp = loop == "raw-ddp"
    if ddp:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg, data).to(device)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None else None)
    elif loop == "dp":
        model = torch.nn.DataParallel(model)
    optimizer = build_optimizer(cfg, model.parameters(), cfg.lr)
    # A plain TensorDataset, one sample per __getitem__, as the hand-written loops have it.
    train = TensorDataset(*data.train.tensors) if isinstance(data.train, TensorDataset) else data.train
    sampler = DistributedSampler(train, shuffle=True, drop_last=True) if ddp else None
    loader = DataLoader(train, batch_size=cfg.batch_size // world, shuffle=sampler is None, sampler=sampler,
                        drop_last=True, num_workers=cfg.num_workers, pin_memory=device.type == "cuda")
    loss_fn = F.cross_entropy if data.task == "classification" else F.mse_loss

    done, epoch, data_time = 0, 0, 0.0
    start = time.perf_counter()
    while done < steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        ready = time.perf_counter()
        for inputs, targets in loader:
            data_time += time.perf_counter() - ready
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            done += 1
            ready = time.perf_counter()
            if done == steps:
                break
        epoch += 1
    loss.item()  # waits for the device, as the end of any real loop does
    elapsed = time.perf_counter() - start
    result = {"loop": loop, "world_size": world, "steps": steps, "time_s": elapsed,
              "samples_per_s": steps * cfg.batch_size / elapsed, "step_time_s": elapsed / steps,
              "data_time_s": data_time / steps, "peak_memory_mb": peak_memory_mb(device)}
    if ddp:
        dist.destroy_process_group()
    return result if rank == 0 else {}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m acc_trainer.baselines")
    parser.add_argument("--loop", choices=("raw", "raw-ddp", "dp"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--config", required=True, help="JSON of TrainConfig options for the workload")
    args = parser.parse_args()
    cfg = TrainConfig(**json.loads(args.config)).validate()
    result = run(args.loop, cfg, args.steps)
    if result:
        print("BASELINE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
