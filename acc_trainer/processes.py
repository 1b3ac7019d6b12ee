"""What the processes of a run must agree on, and the process group they form.

Every process calls each function here; none of them decides alone. `start` forms the group
(Accelerate's PartialState); the checks compare what every process built (the same datasets, the
same initial and final weights) so that a seeding mistake is found, named and, where it can be,
mended, instead of silently training different models.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Callable

import torch
from accelerate import Accelerator, InitProcessGroupKwargs, PartialState
from accelerate.utils import broadcast, broadcast_object_list

from . import engines
from .config import ConfigError, TrainConfig
from .data import Data
from .measure import fingerprint


def start(cfg: TrainConfig) -> tuple[PartialState, str, bool, InitProcessGroupKwargs]:
    """The process group (Accelerate's PartialState, a singleton: calling this again returns the same),
    the engine the accelerate config selects, and whether to run on the CPU."""
    # Without a GPU, cpu=True is what makes processes started by `accelerate launch --multi_gpu`
    # form one gloo group (MULTI_CPU) instead of running as independent copies.
    cpu = cfg.cpu or not torch.cuda.is_available()
    engine = engines.requested()  # FSDP or DEEPSPEED when the accelerate config selects one, else DDP
    engines.leave_deepspeed_alone(engine)
    if engine == "DEEPSPEED":
        engines.check_deepspeed(cfg)
        cpu = False  # Accelerate sets DeepSpeed up only without cpu=True (on a CPU it then runs one process)
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout))
    return PartialState(cpu=cpu, **timeout.to_kwargs()), engine, cpu, timeout


def warn_if_one_process_was_meant(state: PartialState) -> None:
    """Without a GPU, `accelerate launch --num_processes 2` (no --multi_gpu) starts ONE process through
    Accelerate's simple launcher, which still exports MASTER_ADDR but no WORLD_SIZE: say so."""
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ and "MASTER_ADDR" in os.environ
    if state.num_processes == 1 and launched and "WORLD_SIZE" not in os.environ:
        print("acc-trainer: warning: accelerate launch started ONE process (without --multi_gpu it starts several "
              "only on GPUs); for N: accelerate launch --multi_gpu --num_processes N -m acc_trainer ..., or "
              "--config_file accelerate_configs/cpu_ddp.yaml", file=sys.stderr)


def check_topology(cfg: TrainConfig, state: PartialState) -> None:
    world = state.num_processes
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not split into {world} processes x {cfg.grad_accum} "
            f"accumulation micro-batches; use a multiple of {world * cfg.grad_accum}"
        )


def check_same_data(accelerator: Accelerator, data: Data) -> None:
    """Every process must hold the same datasets: with different lengths their shuffles and epochs
    would differ (and one process could wait for the others for ever at an epoch's end)."""
    if accelerator.num_processes == 1:
        return
    from .data import is_stream
    from .streams import fingerprint, first

    if is_stream(data.train) or is_stream(data.eval):  # the first samples' fingerprint: a stream split by process differs
        rows = [fingerprint(first(d, 4)) if is_stream(d) else [float(len(d)), 0.0] if d is not None else [-1.0, 0.0]
                for d in (data.train, data.eval)]
        everywhere = accelerator.gather(torch.tensor([sum(rows, [])], dtype=torch.float64,
                                                     device=accelerator.device)).tolist()
        if any(row != everywhere[0] for row in everywhere):
            raise ConfigError("the datasets differ between processes (their first samples differ): every process must "
                              "build the same data; acc_trainer gives each process its share of a stream, so do not "
                              "split it by process (datasets' split_dataset_by_node, or by rank in __iter__)")
        return
    sizes = [len(data.train), len(data.eval) if data.eval is not None else -1]
    everywhere = accelerator.gather(torch.tensor([sizes], device=accelerator.device)).tolist()
    if any(row != everywhere[0] for row in everywhere):
        shown = "; ".join(f"process {i}: {t} training, {max(e, 0)} evaluation samples" for i, (t, e) in enumerate(everywhere))
        raise ConfigError(f"the datasets differ between processes ({shown}); every process must build the same data")


def same_initial_weights(accelerator: Accelerator, model) -> list[str]:
    """A model built outside the trainer (fit(), or a factory drawing from another generator) may start
    from different weights on each process: all then start from process 0's, as DDP would make them
    (FSDP would not). Returns the note to print."""
    if accelerator.num_processes == 1 or _ranks_equal(accelerator, model):
        return []
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.copy_(broadcast(tensor.detach().to(accelerator.device), from_process=0))
    return ["note: the model's initial weights differed between processes (build it after seeding, e.g. "
            "accelerate.utils.set_seed); every process starts from process 0's"]


def check_ranks_agree(accelerator: Accelerator, model, when: str) -> bool:
    """Compares the parameters of every process (checked, not assumed); a difference is a bug.

    Under FSDP or DeepSpeed each process holds a different shard once the model is prepared:
    there, only the initial (unsharded) model is compared.
    """
    if when != "initial" and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        return True
    # Before `prepare` the model is plain; unwrapping it anyway would import torch._dynamo (~1 s).
    if not _ranks_equal(accelerator, model if when == "initial" else accelerator.unwrap_model(model)):
        raise RuntimeError(f"the {when} parameters differ between processes")
    return True


def _ranks_equal(accelerator: Accelerator, model) -> bool:
    prints = accelerator.gather(fingerprint(model).to(accelerator.device)[None])
    return bool((prints == prints[0]).all())


def summing(accelerator: Accelerator) -> Callable[[list], list] | None:
    """`agree(numbers) -> their sums over every process` for a stream's loader (None on one process)."""
    if accelerator.num_processes == 1:
        return None
    return lambda values: accelerator.reduce(torch.tensor(values, device=accelerator.device), "sum").tolist()


def main_decides(check: Callable[[], None]) -> None:
    """Runs `check` on the main process alone (a lock, a look at the disk); its ConfigError, if any, is
    raised on every process, so that all stop together."""
    error = [None]
    if PartialState().is_main_process:
        try:
            check()
        except ConfigError as e:
            error = [str(e)]
    broadcast_object_list(error)
    if error[0]:
        raise ConfigError(error[0])
