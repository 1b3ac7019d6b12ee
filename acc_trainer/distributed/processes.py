"""What the processes of a run must agree on, and the process group they form.

Every process calls each function here; none of them decides alone. `start` forms the group
(Accelerate's PartialState); the checks compare what every process built (the same datasets, the
same initial and final weights) so that a seeding mistake is found, named and, where it can be,
mended, instead of silently training different models.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

import torch
from accelerate import Accelerator, InitProcessGroupKwargs, PartialState
from accelerate.utils import broadcast, broadcast_object_list, gather_object

from .. import patches
from ..config import ConfigError, TrainConfig, did_you_mean, first_line
from ..data.datasets import Data
from ..workload.measure import fingerprint
from . import engines

T = TypeVar("T")


@dataclass
class Group:
    """The processes of a run: Accelerate's PartialState, the engine the accelerate config selects (DDP, FSDP or
    DEEPSPEED), whether they run on the CPU, and the timeout of their collectives."""

    state: PartialState
    engine: engines.Engine
    cpu: bool
    timeout: InitProcessGroupKwargs


def start(cfg: TrainConfig) -> Group:
    """The process group (Accelerate's PartialState, a singleton: calling this again returns the same),
    the engine the accelerate config selects, and whether to run on the CPU."""
    # Without a GPU, cpu=True is what makes processes started by `accelerate launch --multi_gpu`
    # form one gloo group (MULTI_CPU) instead of running as independent copies.
    check_accelerate_environment()  # before Accelerate reads the variables (it raises on a bad one, deep inside)
    cpu = cfg.cpu or not torch.cuda.is_available()
    engine = engines.requested()  # FSDP2 or DeepSpeed when the accelerate config selects one, else DDP
    patches.apply_to_process()  # Accelerate's per-step lookups once, and no DeepSpeed import (docs/performance.md)
    engine.check(cfg)
    cpu = engine.on_cpu(cpu)
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout))
    state = PartialState(cpu=cpu, **timeout.to_kwargs())
    warn_if_restarts_share_a_store(state)
    return Group(state, engine, cpu, timeout)


# The variables Accelerate reads as it builds its state (accelerate launch and its config files set them), by how it
# parses them: a bad value raises ValueError inside Accelerate, far from the variable that caused it.
ACCELERATE_FLAGS = ("ACCELERATE_USE_CPU", "ACCELERATE_DEBUG_MODE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
                    "ACCELERATE_USE_MEGATRON_LM", "ACCELERATE_CPU_AFFINITY", "ACCELERATE_ENABLE_RICH",
                    "ACCELERATE_INIT_INCLUDE_BUFFERS", "ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_DYNAMIC",
                    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION")
ACCELERATE_COUNTS = ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_NUM_PROCESSES", "ACCELERATE_DEEPSPEED_ZERO_STAGE")


def check_accelerate_environment() -> None:
    """Accelerate's variables with a value it cannot read are one line naming the variable (ConfigError)."""
    from accelerate.utils import DynamoBackend, PrecisionType

    for name in ACCELERATE_FLAGS:
        value = os.environ.get(name)
        if value is not None and value.lower() not in ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false",
                                                       "off", "0"):
            raise ConfigError(f"{name}={value} (in the environment) is not true or false (1/0, yes/no, true/false)")
    for name in ACCELERATE_COUNTS:
        value = os.environ.get(name)
        if value is not None and not (value.strip().isdigit() or name.endswith("ACCUMULATION_STEPS") and value == "auto"):
            raise ConfigError(f"{name}={value} (in the environment) is not a whole number")
    choices = {"ACCELERATE_MIXED_PRECISION": [p.value for p in PrecisionType],
               "ACCELERATE_DYNAMO_BACKEND": [b.value.lower() for b in DynamoBackend]}
    for name, allowed in choices.items():
        value = os.environ.get(name)
        if value is not None and value.lower() not in allowed:
            raise ConfigError(f"{name}={value} (in the environment) is not one of {', '.join(allowed)}"
                              + did_you_mean(value.lower(), allowed))


def warn_if_restarts_share_a_store(state: PartialState) -> None:
    """torch elastic (torchrun, accelerate launch) restarting failed processes (--max-restarts) hands every attempt
    the one store its agent keeps (torch 2.14's c10d rendezvous, and the static one). The keys by which
    the processes find each other's addresses stay there, and a restarted process that reads them before its peer
    rewrites them connects to the dead attempt: it fails, or waits up to --dist-timeout (pytorch/pytorch#135712;
    #167302 proposes a fix). Only the launcher's environment changes that, so it is said at start
    (docs/checkpoints.md)."""
    if (state.is_main_process and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        print("acc-trainer: warning: with --max-restarts the launcher keeps one store for every attempt, where a "
              "restarted attempt can read the dead one's addresses and fail or hang at start; launch with "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the c10d rendezvous (--rdzv-backend c10d, or --standalone): "
              "docs/checkpoints.md", file=sys.stderr)


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
    from ..data.streams import fingerprint, first

    if data.kind.streams:  # the first samples' fingerprint: a stream split by process differs
        rows = [[-1.0, 0.0] if d is None else fingerprint(first(d, 4, heads=data.heads)) if kind.stream else
                [float(kind.length), 0.0] for d, kind in ((data.train, data.kind.train), (data.eval, data.kind.eval))]
        everywhere = accelerator.gather(torch.tensor([sum(rows, [])], dtype=torch.float64,
                                                     device=accelerator.device)).tolist()
        if any(row != everywhere[0] for row in everywhere):
            raise ConfigError("the datasets differ between processes (their first samples differ): every process must "
                              "build the same data; acc_trainer gives each process its share of a stream, so do not "
                              "split it by process (datasets' split_dataset_by_node, or by rank in __iter__)")
        return
    sizes = [data.kind.train.length, data.kind.eval.length if data.eval is not None else -1]
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


def ranks_agree(accelerator: Accelerator, model) -> dict:
    """Whether every process holds the same weights, measured: `agree` is True or False when they were
    compared (each process's fingerprint of its whole model, gathered), None with the reason when there
    is nothing to compare (one process; FSDP and ZeRO-3 keep each weight once, sharded)."""
    world, sharded = accelerator.num_processes, engines.requested().weights_sharded_by()
    reason = "one process" if world == 1 else sharded and (f"{sharded} keeps each weight once, sharded over the "
                                                           "processes: there are no copies to compare")
    if reason:
        return {"agree": None, "detail": f"not checked: {reason}"}
    # DDP and ZeRO-1/2 keep a whole copy on every process (unwrap_model gives DeepSpeed's module too).
    prints = accelerator.gather(fingerprint(accelerator.unwrap_model(model, keep_torch_compile=False))
                                .to(accelerator.device)[None])
    differ = [i for i in range(world) if not torch.equal(prints[i], prints[0])]
    if differ:
        return {"agree": False, "detail": f"the weights of process(es) {', '.join(map(str, differ))} differ from "
                                          "process 0's"}
    return {"agree": True, "detail": f"the same weights on {world} processes (every parameter's sum and sum of "
                                     "squares, compared exactly)"}


def _ranks_equal(accelerator: Accelerator, model) -> bool:
    prints = accelerator.gather(fingerprint(model).to(accelerator.device)[None])
    return bool((prints == prints[0]).all())


def summing(accelerator: Accelerator) -> Callable[[list], list] | None:
    """`agree(numbers) -> their sums over every process` for a stream's loader (None on one process)."""
    if accelerator.num_processes == 1:
        return None
    return lambda values: accelerator.reduce(torch.tensor(values, device=accelerator.device), "sum").tolist()


class MainProcessFailed(Exception):
    """Raised on the other processes when the main process failed at a step they all wait for (`main_decides`,
    `each_tries`): the failed process's error, its type and first line. That process raises its own error, with its
    traceback."""


def main_decides(make: Callable[[], T]) -> T:
    """What `make()` returns on the main process alone (a look at the disk, a folder's name, a file only it reads),
    handed to every process. Whatever happens, an outcome is handed over, so that no process is left waiting for
    one that failed: a ConfigError is raised on every process with its line; any other error is raised on the main
    process as it is, and as MainProcessFailed naming it on the others. Every process calls this; the one place
    where the main process computes and the others wait (test_layout holds it)."""
    state = PartialState()
    outcome, error = [None], None
    if state.is_main_process:
        outcome, error = _outcome(make)
    if state.num_processes > 1:
        broadcast_object_list(outcome)
    return _agreed(outcome, error, "the main process")


def each_tries(make: Callable[[], T]) -> list[T]:
    """What `make()` returns on every process, in process order, on each; an error on any process is raised on
    every one, as main_decides raises the main's."""
    state = PartialState()
    outcome, error = _outcome(make)
    if state.num_processes == 1:
        return [_agreed(outcome, error, "the process")]
    everywhere = gather_object(outcome)
    for index, held in enumerate(everywhere):
        if held[0] != "made":
            _agreed([held], error if index == state.process_index else None, f"process {index}")
    return [value for _, value in everywhere]


def _outcome(make: Callable[[], T]) -> tuple[list, BaseException | None]:
    try:
        return [("made", make())], None
    except ConfigError as e:
        return [("config", str(e))], e
    except BaseException as e:  # a bug, a full disk, Ctrl-C: its own traceback here, and no one left waiting
        return [("failed", f"{type(e).__name__}: {first_line(e)}")], e


def _agreed(outcome: list, error: BaseException | None, who: str):
    if error is not None:
        raise error
    kind, value = outcome[0]
    if kind == "config":
        raise ConfigError(value)
    if kind == "failed":
        raise MainProcessFailed(f"{who} failed ({value}); this process stopped with it")
    return value
