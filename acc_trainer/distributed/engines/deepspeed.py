"""DeepSpeed: ZeRO partitions of flattened tensors, its own optimizer step inside the backward pass, its own
checkpoint format.

`accelerate launch --config_file accelerate_configs/deepspeed.yaml` tells the processes through
ACCELERATE_USE_DEEPSPEED; Accelerate then builds DeepSpeed's engine in `prepare`. What is here turns every setup
Accelerate would mishandle into one line (`check`), hands DeepSpeed the trainer's accumulation, clipping and batch
(`accelerator_kwargs`, `before_prepare`), leaves the frozen parameters out of its checkpoints (DeepSpeed's own
`exclude_frozen_parameters`), gathers a ZeRO-3 model's weights a module at a time (`gather`), and reads its
checkpoints into whole tensors through DeepSpeed's own zero_to_fp32 (`acc-trainer consolidate`). Its checkpoints
continue under DeepSpeed with the same number of processes only; a new run starts from their consolidated weights
(--init-from).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

from ... import patches
from ...config import ConfigError, TrainConfig
from .base import Engine, save_gathered

DEEPSPEED_MODEL = "pytorch_model"  # DeepSpeed's checkpoint tag under Accelerate: its folder in the checkpoint


class DeepSpeed(Engine):
    """DeepSpeed (ZeRO stages 1 to 3), through Accelerate's DeepSpeedPlugin."""

    name, shards, keeps_gradients, holds_4bit, moves = "DEEPSPEED", True, True, False, False

    @property
    def label(self) -> str:
        return "DeepSpeed"

    def check(self, cfg: TrainConfig) -> None:
        """Checked before the process group exists: Accelerate would fail inside its setup, or quietly
        train something else."""
        super().check(cfg)
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
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        _check_offload(cfg, _deepspeed_file(cfg, path) if path != "none" else {})

    def on_cpu(self, cpu: bool) -> bool:
        return False  # Accelerate sets DeepSpeed up only without cpu=True (on a CPU it then runs one process)

    def accelerator_kwargs(self, cfg: TrainConfig) -> dict:
        """The trainer's --grad-accum and --max-grad-norm, whatever the config (Accelerate 1.15 leaves gradient_clipping
        out for 0, and DeepSpeed 0.19 then clips at its default, 1.0: a run without --max-grad-norm was clipped), and
        ZeRO-3 made to gather the whole weights for the final save (`get_state_dict` refuses otherwise, after the
        training)."""
        plugin = DeepSpeedPlugin(gradient_accumulation_steps=cfg.grad_accum, gradient_clipping=cfg.max_grad_norm or 0.0)
        config = plugin.deepspeed_config
        config["gradient_accumulation_steps"] = cfg.grad_accum  # a config file without one would have 1 (Accelerate)
        config["gradient_clipping"] = cfg.max_grad_norm or 0.0
        if plugin.zero_stage == 3:  # stage3_gather_16bit_weights_on_model_save, whatever zero3_save_16bit_model says
            config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        return {"deepspeed_plugin": plugin}

    def weights_sharded_by(self) -> str | None:
        return "DeepSpeed ZeRO-3" if zero_stage() == 3 else None

    def before_prepare(self, accelerator: Accelerator, model: torch.nn.Module,
                       per_process_batch: int) -> tuple[torch.dtype | None, list[str]]:
        """The training loader's batches come from a batch sampler, so DeepSpeed is told the per-process batch; and its
        bf16/fp16 casts the weights themselves (no autocast), so batches are cast to match."""
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = per_process_batch
        config["train_batch_size"] = per_process_batch * config["gradient_accumulation_steps"] * accelerator.num_processes
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision), []

    def placement(self, placement: list) -> list | None:
        return None  # DeepSpeed refuses a device_placement list

    def save_checkpoint(self, accelerator: Accelerator, folder: Path, trainable_only: bool) -> None:
        # DeepSpeed leaves the frozen parameters out of its own files itself
        with patches.shared_tensors_unsaid():
            accelerator.save_state(str(folder), **({"exclude_frozen_parameters": True} if trainable_only else {}))

    def load_checkpoint(self, accelerator: Accelerator, path: Path, trainable_only: bool) -> None:
        # DeepSpeed's own loader takes no `strict`
        accelerator.load_state(str(path), **({"load_module_strict": False} if trainable_only else {}))

    def check_holds_trainable(self, path: Path, model, check) -> None:
        return None  # DeepSpeed restores what trains from its optimizer's own copy

    def missing_files(self, names: set[str]) -> list[str]:
        return [] if any(name.startswith("pytorch_model") for name in names) else ["the model's pytorch_model* files"]

    def why_stuck(self, path: Path) -> str:
        return ("DeepSpeed's checkpoints continue under DeepSpeed with the same number of processes only (its files are "
                f"ZeRO partitions of flattened tensors). Its weights go elsewhere with `acc-trainer consolidate {path} "
                "OUT`, then --init-from OUT (a new run from those weights, without the optimizer state)")

    def holds(self, path: Path) -> bool:
        return (path / DEEPSPEED_MODEL).is_dir()

    def whole_weights(self, path: Path) -> dict[str, torch.Tensor]:
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise ConfigError(f"checkpoint {path} was written by DeepSpeed, whose files only DeepSpeed reads: "
                              'pip install -e ".[deepspeed]"') from None
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_MODEL))

    def save_weights(self, accelerator: Accelerator, model, module, folder: Path) -> None:
        with patches.shared_tensors_unsaid():
            state = accelerator.get_state_dict(model)  # gathered by every process (ZeRO-3's partitions)
            if accelerator.is_main_process:  # a tied weight once, as DDP's file holds it
                save_gathered(state, module, folder)

    def holds_model(self, model) -> bool:
        """The model's parameters are ZeRO-3 partitions (DeepSpeed gives them ds_id and ds_numel)."""
        return any(hasattr(p, "ds_id") for p in model.parameters())

    def gather(self, model, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        return zero3_state(model, trainable_only)


def _check_offload(cfg: TrainConfig, given: dict) -> None:
    """Offloading (the DeepSpeed config file's, else the accelerate config's) that would train something else, or fail
    as DeepSpeed builds its engine."""
    offload = {kind: given.get("zero_optimization", {}).get(f"offload_{kind}", {}).get("device")
               or os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none")
               for kind in ("optimizer", "param")}
    if (offload["optimizer"] != "none" and given.get("zero_force_ds_cpu_optimizer", True)
            and cfg.optimizer not in ("adam", "adamw")):
        # accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed: any torch optimizer becomes DeepSpeedCPUAdam
        raise ConfigError(f"offload_optimizer_device {offload['optimizer']}: Accelerate replaces the optimizer with "
                          f"DeepSpeed's CPU Adam, so --optimizer {cfg.optimizer} would train as Adam: use --optimizer adam "
                          "or adamw, or offload_optimizer_device: none")
    if "nvme" in offload.values():
        from deepspeed.ops.op_builder import AsyncIOBuilder  # imported for NVMe only (3 s)

        if not AsyncIOBuilder().is_compatible(verbose=False):  # DeepSpeed would fail as it builds the engine
            raise ConfigError("offload to nvme needs DeepSpeed's async_io operation, which cannot be built here (it needs "
                              "libaio's headers: apt install libaio-dev): offload to cpu, or to none")


def _deepspeed_file(cfg: TrainConfig, path: str) -> dict:
    """A DeepSpeed config file of the user's (deepspeed_config_file), checked: Accelerate refuses an optimizer or
    scheduler in it beside the trainer's (deep in `prepare`), and its accumulation and clipping would override the
    trainer's flags."""
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"the DeepSpeed config file {path} cannot be read: {e}") from None
    for section, option in (("optimizer", "--optimizer"), ("scheduler", "--scheduler")):
        if section in given:
            raise ConfigError(f"the DeepSpeed config file {path} has a section {section!r}; acc_trainer builds the "
                              f"{section} from {option} and hands it to DeepSpeed: remove the section")
    for key, option, value in (("gradient_accumulation_steps", "--grad-accum", cfg.grad_accum),
                               ("gradient_clipping", "--max-grad-norm", cfg.max_grad_norm or 0.0)):
        if given.get(key, "auto") != "auto" and _number(str(given[key])) != value:
            raise ConfigError(f"the DeepSpeed config file {path} sets {key} {given[key]}; acc_trainer passes {option} "
                              f"({value}) to DeepSpeed: remove it from the file, or set it to \"auto\"")
    return given


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def zero_stage() -> int:
    """The ZeRO stage the accelerate config asks DeepSpeed for, as Accelerate's DeepSpeedPlugin reads it (a DeepSpeed
    config file's, else the launcher's, else 2); meaningful where the config selects DeepSpeed (`requested`)."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    stage = json.loads(Path(path).read_text()).get("zero_optimization", {}).get("stage") if path != "none" else None
    return int(stage if stage not in (None, "auto") else os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))


def zero3_state(model, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every process: a ZeRO-3 model's state dict with whole tensors, on the main process's CPU (`{}` on the
    others), gathered one module at a time as DeepSpeed's own consolidation does. `trainable_only`: the
    parameters that train and the buffers, as a checkpoint of a partly frozen model keeps them."""
    import deepspeed
    from accelerate import PartialState

    main = PartialState().is_main_process
    names = model.state_dict(keep_vars=True).keys()  # the parameters and persistent buffers, as the model names them
    state = {}
    for prefix, module in model.named_modules():
        own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)
               if p.requires_grad or not trainable_only]
        with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
            if main:
                state.update((n, p.detach().cpu().clone()) for n, p in own if n in names)
    if not main:
        return {}
    buffers = {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n in names}
    return {n: state.get(n, buffers.get(n)) for n in names if n in state or n in buffers}
