"""FSDP and DeepSpeed, the engines an accelerate config can select, and the gaps Accelerate 1.15
leaves around them that would otherwise break a run or quietly train something else.

`accelerate launch --config_file accelerate_configs/fsdp.yaml` (or deepspeed.yaml) tells the
processes through ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED; Accelerate then prepares the model
with its own FSDP2 or DeepSpeed code. What is here makes that hold on CPU processes too (FSDP2 over
gloo; DeepSpeed as one CPU process) and turns every setup Accelerate would mishandle into one line.
"""

from __future__ import annotations

import importlib.util
import os

import accelerate
import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

from .. import patches
from ..config import ConfigError, TrainConfig


def requested() -> str:
    """The engine the accelerate config selects through accelerate launch: FSDP, DEEPSPEED, or DDP for neither."""
    for engine in ("FSDP", "DEEPSPEED"):
        if os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true":
            return engine
    return "DDP"


def check_deepspeed(cfg: TrainConfig) -> None:
    """Checked before the process group exists: Accelerate would fail inside its setup, or quietly
    train something else."""
    missing = [name for name in ("deepspeed", "transformers") if importlib.util.find_spec(name) is None]
    if missing:  # Accelerate 1.15's DeepSpeed setup imports transformers too
        raise ConfigError(f"the accelerate config selects DeepSpeed, which needs {' and '.join(missing)}: "
                          'pip install -e ".[deepspeed]"')
    if cfg.cpu:
        raise ConfigError("--cpu does not combine with DeepSpeed (Accelerate leaves DeepSpeed out for cpu=True); "
                          "on CPUs use accelerate_configs/fsdp.yaml or cpu_ddp.yaml")
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("without a GPU, DeepSpeed runs as one process only (Accelerate 1.15 would make every CPU "
                          "process a world of its own): launch it with --num_processes 1, or use "
                          "accelerate_configs/fsdp.yaml or cpu_ddp.yaml for several CPU processes")
    # The launcher exports these from the config's deepspeed_config; Accelerate would let them override
    # the trainer's own settings (and fails on "auto").
    for variable, option, value in (("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "--grad-accum", cfg.grad_accum),
                                    ("ACCELERATE_GRADIENT_CLIPPING", "--max-grad-norm", cfg.max_grad_norm or 0.0)):
        given = os.environ.get(variable)
        if given is not None and _number(given) != value:
            raise ConfigError(f"the accelerate config sets {variable.split('_', 1)[1].lower()} {given}; acc_trainer "
                              f"passes {option} ({value}) to DeepSpeed: remove it from the config's deepspeed_config")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def set_up(accelerator: Accelerator, engine: str) -> None:
    """FSDP on CPU processes, and no engine silently replaced by another.

    torch's FSDP2 shards over gloo (CPU) as well as NCCL, but Accelerate 1.15 switches FSDP on only
    for GPU process groups: CPU processes launched with fsdp.yaml would quietly train plain DDP. For
    them patches.fsdp_on_cpu sets FSDP up as Accelerate does for a GPU group, with the plugin Accelerate
    reads from the launcher's environment.
    """
    if engine == "FSDP" and accelerator.distributed_type == DistributedType.MULTI_CPU:
        plugin = FullyShardedDataParallelPlugin()
        if plugin.fsdp_version != 2:
            raise ConfigError("FSDP on CPU processes needs fsdp_version: 2 in the accelerate config (FSDP2, as "
                              "accelerate_configs/fsdp.yaml)")
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        if not patches.fsdp_on_cpu(accelerator, plugin):
            raise ConfigError(f"FSDP on CPU processes is set up only on the Accelerate acc_trainer was tested on "
                              f"({patches.written_for('accelerate')}), not {accelerate.__version__}; on CPUs use "
                              "accelerate_configs/cpu_ddp.yaml")
    if engine != "DDP" and accelerator.distributed_type != DistributedType[engine]:
        raise ConfigError(f"the accelerate config selects {engine} but Accelerate set up "
                          f"{accelerator.distributed_type.value} on {accelerator.device.type}; start the "
                          "processes with accelerate launch --config_file accelerate_configs/...")


def deepspeed_plugin(cfg: TrainConfig) -> DeepSpeedPlugin:
    """The trainer's --grad-accum and --max-grad-norm, not Accelerate's defaults ("auto" would clip at 1.0)."""
    return DeepSpeedPlugin(gradient_accumulation_steps=cfg.grad_accum, gradient_clipping=cfg.max_grad_norm or 0.0)


def prepare_deepspeed(accelerator: Accelerator, per_process_batch: int) -> torch.dtype | None:
    """Before `prepare` under DeepSpeed; returns the dtype batches must have (None: as they are).

    The training loader's batches come from a batch sampler, so DeepSpeed is told the per-process
    batch; and its bf16/fp16 casts the weights themselves (no autocast), so batches are cast to match.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = per_process_batch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
