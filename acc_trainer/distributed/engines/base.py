"""What every engine answers (`Engine`), with what they share: a checkpoint moved in from another engine or number of
processes through torch's state-dict functions, and final weights written whole from a gathered state dict.

Moving: `accelerator.load_state` reads a checkpoint in the form its own engine wrote it. Between two numbers of
processes under one engine it needs no help (DDP's files are whole; FSDP2's distributed checkpoint reshards on load).
Between engines, the checkpoint's own engine reads its files (`read_model`, `read_optimizer`: whole tensors keyed by
parameter name, or a distributed checkpoint read straight into the model's own tensors) and torch's state-dict functions
(`set_model_state_dict`, `set_optimizer_state_dict`) put each process's part in place for a plain, a DDP or an FSDP2
model alike. The LR schedule is `scheduler.bin` under every engine; the random states are restored by the caller
(checkpoints.check_random_states).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ... import patches
from ...config import ConfigError, TrainConfig

COMPILED = "_orig_mod"  # torch.compile's wrapper: the module it holds, a segment of its parameters' names


class Engine:
    """One engine's answers; the defaults are plain processes' and DDP's (ddp.py), each other engine's room says
    where it differs."""

    name = "DDP"  # as checkpoints and the accelerate config name it (DDP also for one process)
    shards = False  # each process holds a part of the weights (or of their training state): no whole model there
    keeps_gradients = False  # the engine steps inside backward, its gradients its own (DeepSpeed)
    holds_4bit = True  # a 4-bit base (bitsandbytes' packed weights) can train under it
    moves = True  # its checkpoints continue under another engine or number of processes, and it takes theirs

    def __str__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ before the processes and the Accelerator

    def check(self, cfg: TrainConfig) -> None:
        """What cannot run under this engine, checked before the process group exists (one line each)."""
        if cfg.load_in_4bit:
            self.check_4bit()

    def check_4bit(self) -> None:
        """A 4-bit base trains under DDP: one line, before the first step, for an engine that cannot hold one."""
        if not self.holds_4bit:
            raise ConfigError(f"the accelerate config selects {self.label}, which cannot hold a 4-bit base (it would "
                              "shard or flatten bitsandbytes' packed weights apart from their quantization state): train "
                              "--load-in-4bit under DDP (--multi_gpu, or accelerate_configs/cpu_ddp.yaml)")

    @property
    def label(self) -> str:
        return self.name

    def on_cpu(self, cpu: bool) -> bool:
        """Whether Accelerate's state is built with cpu=True."""
        return cpu

    def accelerator_kwargs(self, cfg: TrainConfig) -> dict:
        """The engine's plugin among the Accelerator's arguments (a training run's)."""
        return {}

    def set_up(self, accelerator: Accelerator) -> None:
        """The engine Accelerate set up is this one: never silently replaced by another."""
        if self.name != "DDP" and accelerator.distributed_type != DistributedType[self.name]:
            raise ConfigError(f"the accelerate config selects {self.name} but Accelerate set up "
                              f"{accelerator.distributed_type.value} on {accelerator.device.type}; start the "
                              "processes with accelerate launch --config_file accelerate_configs/...")

    def weights_sharded_by(self) -> str | None:
        """What splits the weights themselves over the processes (FSDP, DeepSpeed ZeRO-3), as a message says it; None:
        every process holds them whole."""
        return None

    # ------------------------------------------------------------------------------------------------ prepare

    def before_prepare(self, accelerator: Accelerator, model: torch.nn.Module,
                       per_process_batch: int) -> tuple[torch.dtype | None, list[str]]:
        """Before `prepare`: the dtype batches must have (None: as they are) and the start line's notes."""
        return None, []

    def placement(self, placement: list) -> list | None:
        """`prepare`'s device_placement list (None where the engine refuses one)."""
        return placement

    def after_prepare(self, accelerator: Accelerator, model, frozen: list, frozen_names: set) -> list:
        """Once prepared: the frozen parameters (--freeze's, the same objects unless the engine replaced them)."""
        return frozen

    # ---------------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, accelerator: Accelerator, folder: Path, trainable_only: bool) -> None:
        """`save_state` into `folder` (every process); `trainable_only`: the frozen weights left out."""
        with patches.shared_tensors_unsaid():  # tied weights saved once
            accelerator.save_state(str(folder))

    def load_checkpoint(self, accelerator: Accelerator, path: Path, trainable_only: bool) -> None:
        """`load_state` from a checkpoint this engine wrote. strict=False lets the frozen tensors be missing."""
        accelerator.load_state(str(path), **({"strict": False} if trainable_only else {}))

    def check_holds_trainable(self, path: Path, model, check) -> None:
        """A checkpoint of what trains holds every tensor that trains (`check(path, model)`, language/adapters.py)."""
        check(path, model)

    def missing_files(self, names: set[str]) -> list[str]:
        """What a checkpoint this engine wrote lacks of its own files (their loaders check the rest)."""
        return [name for name in ("model.safetensors", "optimizer.bin") if name not in names]

    def check_move(self, path: Path, saved: Engine, saved_world: int, world: int) -> None:
        """The checkpoint of `saved_world` processes under `saved` continues here, or one line says what converts it."""
        stuck = next((engine for engine in (saved, self) if not engine.moves), None)
        if stuck is not None and (saved.name != self.name or saved_world != world):
            raise ConfigError(f"checkpoint {path} was written by {saved_world} process(es) under {saved.name}, and this "
                              f"run is {world} under {self.name}: {stuck.why_stuck(path)}")

    def why_stuck(self, path: Path) -> str:
        """Why this engine's checkpoints continue under it alone, and how their weights go elsewhere."""
        return ""

    def move_in(self, accelerator: Accelerator, model, optimizer, scheduler, path: Path, saved: Engine,
                trainable_only: bool) -> None:
        """Another engine's checkpoint (`saved`'s files) into this run's prepared objects (every process)."""
        if accelerator._custom_objects:
            raise ConfigError(f"checkpoint {path}: --ema's average continues under the engine that wrote the checkpoint "
                              "only; resume it there")
        model = self.loading_module(accelerator, model)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper: torch's optimizer inside
        saved.read_model(model, path, trainable_only)
        saved.read_optimizer(model, optimizer, path)
        scheduler.load_state_dict(torch.load(path / "scheduler.bin", weights_only=True))
        if accelerator.scaler is not None and (path / "scaler.pt").is_file():
            accelerator.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
        accelerator.wait_for_everyone()

    def loading_module(self, accelerator: Accelerator, model):
        """The module torch's state-dict functions load another engine's checkpoint into."""
        return accelerator.unwrap_model(model, keep_torch_compile=False)

    def holds(self, path: Path) -> bool:
        """The checkpoint at `path` is in this engine's own files."""
        return True

    def read_model(self, model, path: Path, trainable_only: bool) -> None:
        raise ConfigError(f"checkpoint {path} was written under {self.label}, whose files continue under {self.label} only")

    def read_optimizer(self, model, optimizer, path: Path) -> None:
        raise ConfigError(f"checkpoint {path} was written under {self.label}, whose files continue under {self.label} only")

    def whole_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """A checkpoint's model weights, whole tensors by parameter name, on this one process's CPU (consolidate)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- final weights

    def save_weights(self, accelerator: Accelerator, model, module, folder: Path) -> None:
        """The final weights into `folder` as `save_model` writes a DDP model's (every process lists the folder: it
        stays until all are done)."""
        with patches.shared_tensors_unsaid():  # tied weights, saved once and tied again on load
            accelerator.save_model(model, folder)

    def module_to_save(self, accelerator: Accelerator, model):
        """What the final weights are saved from: the module itself under DDP (Accelerate saves a compiled model under
        its wrapper's names, `_orig_mod.fc1.weight`); the engine's wrapper where it gathers the weights."""
        return model if self.shards else accelerator.unwrap_model(model, keep_torch_compile=False)

    def holds_model(self, model) -> bool:
        """The model's weights are split by this engine (its gathering is needed for whole weights)."""
        return False

    def gather(self, model, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Every process: the whole weights of a model this engine splits, on the main process (`{}` on the others);
        None where every process holds them whole."""
        return None


def save_gathered(state: dict, module, folder: Path) -> None:
    """DeepSpeed's and FSDP2's final weights (main process), `state` from `accelerator.get_state_dict` (ZeRO-3's gathered
    one layer at a time onto the main process's CPU, FSDP2's shards gathered whole), written as `save_model` writes a
    DDP model's: model.safetensors (or shards and their index), a weight tied in `module` once, under its first name.
    Accelerate's own save_model writes a tied weight twice under ZeRO-1/2 and FSDP2 (each tensor gathered apart), and
    under ZeRO-3 on a CPU, whose gathered tensors are views of one flat buffer, keeps one of them as if all were tied."""
    from huggingface_hub import save_torch_state_dict

    tied = {name for name, _ in module.named_parameters(remove_duplicate=False)} - dict(module.named_parameters()).keys()
    kept = {name: tensor for name, tensor in state.items() if name not in tied}
    shared = Counter(tensor.untyped_storage().data_ptr() for tensor in kept.values())
    # A tensor that shares its storage, or is a view of a larger one (FSDP2's gathered uneven shards), is copied out:
    # safetensors writes whole storages only.
    kept = {name: tensor.clone() if shared[tensor.untyped_storage().data_ptr()] > 1
            or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() else tensor
            for name, tensor in kept.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(kept, folder, max_shard_size="10GB")  # save_model's default


def unwrapped_name(name: str) -> str:
    """A parameter's name without torch.compile's `_orig_mod` segments (a compiled model's, or a compiled block's:
    `_orig_mod.model.layers.0.mlp.up_proj.weight`, `model.layers.0._orig_mod.mlp.up_proj.weight`), as torch's
    state-dict functions name it and as a checkpoint of an uncompiled model holds it."""
    return ".".join(part for part in name.split(".") if part != COMPILED)


def one_process() -> bool:
    """No process group (a run of one process): a distributed checkpoint is read by this process alone."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())

