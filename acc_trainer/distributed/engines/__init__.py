"""The engines a run trains under, one room each with the same answers (`base.Engine`): plain processes and DDP
(`ddp.py`), FSDP2 (`fsdp2.py`), DeepSpeed (`deepspeed.py`). Each holds what differs for it: the checks before the
process group, the Accelerate plugin or settings and the engine set up, what `prepare` needs, the whole weights gathered
where each process holds a shard, its checkpoints saved and loaded (trainable-only, sharded or whole), a checkpoint
moved in from another engine or number of processes, and its files read whole (`acc-trainer consolidate`). The run asks
the engine object (`Group.engine`, `Run.engine`); nothing outside this folder (and patches.py, the upstream
workarounds) asks which engine runs: tests/test_layout.py holds it.

The engine is the one the accelerate config selects through `accelerate launch` (`requested`): ACCELERATE_USE_FSDP or
ACCELERATE_USE_DEEPSPEED, else DDP (one process is in DDP's room too).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .base import Engine
from .ddp import DDP
from .deepspeed import DeepSpeed, zero_stage
from .fsdp2 import FSDP2, own_class

ENGINES = {engine.name: engine for engine in (DDP, FSDP2, DeepSpeed)}

__all__ = ["DDP", "ENGINES", "FSDP2", "DeepSpeed", "Engine", "gathered", "of", "own_class", "requested", "whole_weights",
           "zero_stage"]


def of(name: str | Engine) -> Engine:
    """The engine named as checkpoints record it (DDP, FSDP, DEEPSPEED), or the engine given."""
    return name if isinstance(name, Engine) else ENGINES[name]()


def requested() -> Engine:
    """The engine the accelerate config selects through accelerate launch: FSDP, DeepSpeed, or DDP for neither."""
    for name in ("FSDP", "DEEPSPEED"):
        if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true":
            return of(name)
    return DDP()


def gathered(model, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
    """Every process: the whole weights of a model whose engine splits them (FSDP2's shards, ZeRO-3's partitions) on
    the main process; None for a model each process holds whole. `trainable_only`: what trains, and the buffers."""
    engine = next((engine for engine in (DeepSpeed(), FSDP2()) if engine.holds_model(model)), None)
    return engine.gather(model, trainable_only) if engine is not None else None


def writer(path: Path) -> Engine:
    """The engine whose files the checkpoint at `path` holds."""
    return next((engine for engine in (DeepSpeed(), FSDP2()) if engine.holds(path)), DDP())


def whole_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights, whole tensors by parameter name, on the CPU of this one process, whichever engine
    wrote them (DDP's model.safetensors, FSDP's distributed checkpoint or its FULL_STATE_DICT file, DeepSpeed's ZeRO
    partitions through DeepSpeed's own zero_to_fp32): what `acc-trainer consolidate` writes."""
    return writer(path).whole_weights(path)
