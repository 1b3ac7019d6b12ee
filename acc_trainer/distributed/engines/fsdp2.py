"""FSDP2: each process holds a shard of every parameter (a DTensor), gathered where whole weights are needed.

`accelerate launch --config_file accelerate_configs/fsdp.yaml` tells the processes through ACCELERATE_USE_FSDP;
Accelerate then prepares the model with its own FSDP2 code. What is here makes that hold on CPU processes too (FSDP2
over gloo: `set_up`), checks the auto-wrap policy where Accelerate would stop with torch's traceback (`_units`), keeps
what trains in a checkpoint of a partly frozen model (patches.sharded_trainable_only), and reads its distributed
checkpoint (`pytorch_model_fsdp_0/`, `optimizer_0/`: torch's format, one file per process, resharded on load) into
another engine's model or into whole tensors (`acc-trainer consolidate`).

Whole weights exist only once gathered, which every process takes part in (torch's `get_model_state_dict` with
`full_state_dict`, put on the CPU of the main process alone, so no process holds more than one copy): the adapter in
peft's format, a merged model, the final weights.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path

import accelerate
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from ... import patches
from ...config import ConfigError, TrainConfig
from .base import Engine, one_process, save_gathered, unwrapped_name
from .ddp import DDP

SHARDED_MODEL, SHARDED_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"  # FSDP's distributed checkpoint


class FSDP2(Engine):
    """FSDP2 (the accelerate config's fsdp_version 2)."""

    name, shards, label, holds_4bit = "FSDP", True, "FSDP", False

    def check(self, cfg: TrainConfig) -> None:
        """FSDP setups that cannot run on these processes, one line each, before the process group exists."""
        super().check(cfg)
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
        if offload and (cfg.cpu or not torch.cuda.is_available()):  # torch would fail in pin_memory, mid-setup
            raise ConfigError("fsdp_offload_params: true moves the weights between a GPU and the CPU's memory, and these "
                              "processes run on the CPU (their weights are in its memory already): set it to false in the "
                              "accelerate config")
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 and (cfg.cpu or not torch.cuda.is_available()):
            # Accelerate 1.15 sets FSDP up on CPUs for several processes only (set_up), and one has nothing to shard.
            raise ConfigError("the accelerate config selects FSDP for one CPU process, which has nothing to shard: run the "
                              "same acc-trainer command without the launcher (one plain process; it continues an FSDP2 "
                              "checkpoint too), or launch 2 or more processes")

    def set_up(self, accelerator: Accelerator) -> None:
        """FSDP on CPU processes: torch's FSDP2 shards over gloo (CPU) as well as NCCL, but Accelerate 1.15 switches
        FSDP on only for GPU process groups, so CPU processes launched with fsdp.yaml would quietly train plain DDP. For
        them patches.fsdp_on_cpu sets FSDP up as Accelerate does for a GPU group, with the plugin Accelerate reads from
        the launcher's environment."""
        # A second run in the same processes (a second fit()) finds FSDP in the processes' state and no plugin yet.
        if accelerator.device.type == "cpu" and accelerator.num_processes > 1 and (
                accelerator.distributed_type == DistributedType.MULTI_CPU or not getattr(accelerator.state, "fsdp_plugin", None)):
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
        super().set_up(accelerator)

    def weights_sharded_by(self) -> str | None:
        return "FSDP"

    def before_prepare(self, accelerator: Accelerator, model: torch.nn.Module,
                       per_process_batch: int) -> tuple[torch.dtype | None, list[str]]:
        return None, _units(accelerator, model)

    def after_prepare(self, accelerator: Accelerator, model, frozen: list, frozen_names: set) -> list:
        return found_again(model, frozen_names) if accelerator.is_fsdp2 else frozen

    def save_checkpoint(self, accelerator: Accelerator, folder: Path, trainable_only: bool) -> None:
        with patches.sharded_trainable_only(trainable_only):
            super().save_checkpoint(accelerator, folder, trainable_only)

    def load_checkpoint(self, accelerator: Accelerator, path: Path, trainable_only: bool) -> None:
        with patches.sharded_trainable_only(trainable_only):
            super().load_checkpoint(accelerator, path, trainable_only)

    def missing_files(self, names: set[str]) -> list[str]:
        # FSDP names its files after the state-dict type; its loader checks the rest.
        missing = [] if any(name.startswith("pytorch_model") for name in names) else ["the model's pytorch_model* files"]
        return missing + ([] if any(name.startswith("optimizer") for name in names) else ["the optimizer's optimizer* files"])

    def loading_module(self, accelerator: Accelerator, model):
        return model  # torch's state-dict functions take the sharded model as it is

    def holds(self, path: Path) -> bool:
        return (path / SHARDED_MODEL).is_dir()

    def read_model(self, model, path: Path, trainable_only: bool) -> None:
        """Read into the model's own tensors, resharded as they are now (FULL_STATE_DICT's whole file: as DDP's)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        if not self.holds(path):
            return DDP().read_model(model, path, trainable_only)
        options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
        state = get_model_state_dict(model, options=options)
        if trainable_only:  # a frozen tied weight's other name too (torch drops the first name only), as it was saved
            frozen = {unwrapped_name(name) for name, p in model.named_parameters(remove_duplicate=False)
                      if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        state = {"model": state}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / SHARDED_MODEL)), no_dist=one_process())
        set_model_state_dict(model, state["model"], options=options)

    def read_optimizer(self, model, optimizer, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if not (path / SHARDED_OPTIMIZER).is_dir():
            return DDP().read_optimizer(model, optimizer, path)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / SHARDED_OPTIMIZER)), no_dist=one_process())
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    def whole_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """Every shard of the distributed checkpoint, read into whole tensors by this one process."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not self.holds(path):
            return DDP().whole_weights(path)
        reader = dcp.FileSystemReader(str(path / SHARDED_MODEL))
        held = reader.read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in held.items()
                 if isinstance(m, TensorStorageMetadata)}
        with warnings.catch_warnings():  # torch says it reads in one process, which is what no_dist asks
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
        return {k.removeprefix("model."): v for k, v in state.items()}  # Accelerate saves {"model": state dict}

    def save_weights(self, accelerator: Accelerator, model, module, folder: Path) -> None:
        with patches.shared_tensors_unsaid():
            state = accelerator.get_state_dict(model)  # the shards gathered by every process
            if accelerator.is_main_process:  # a tied weight once, as DDP's file holds it
                save_gathered(state, module, folder)

    def holds_model(self, model) -> bool:
        """The model's parameters are split over the processes: FSDP2 shards some of its modules. Asked of the modules,
        not of the parameters: the parameter groups that do not reshard after a forward pass (the root's, and
        Accelerate's group of embeddings, final norm and head) can be left gathered, plain tensors and not DTensors,
        until the next backward pass or `state_dict()` (torch 2.14: seen after a DPO run's last evaluation); a model
        not cut by layers (none for fsdp.yaml's policy to make units of) has all of its parameters there and then
        showed no DTensor at all."""
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(m, FSDPModule) for m in model.modules())

    def gather(self, model, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The state dict with whole tensors on the main process's CPU (`{}` on the others); `trainable_only`: the
        parameters that train (and the buffers), as a checkpoint of a partly frozen model keeps them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                    ignore_frozen_params=trainable_only))


def own_class(module) -> type:
    """A module's own class: FSDP2 renames it (FSDPLlamaForCausalLM), its own is the first that is not FSDP's."""
    return next(c for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))


def found_again(model, names: set) -> list:
    """The parameters NAMES (--freeze's, found before `prepare`) of a model FSDP2 has sharded: `fully_shard` replaces
    every parameter with a sharded one, a new object, and gradients dropped from the old ones until --unfreeze-at
    would leave the layers training (DDP and DeepSpeed keep the objects). Names are compared as Accelerate compares
    them for FSDP2 (`fsdp2_canonicalize_names`: without torch.compile's `_orig_mod` and activation checkpointing's
    `_checkpoint_wrapped_module`, which a model compiled by its user or Accelerate's FSDP2 options add)."""
    from accelerate.utils.fsdp_utils import fsdp2_canonicalize_names

    wanted = fsdp2_canonicalize_names(dict.fromkeys(names))
    found = [p for name, p in fsdp2_canonicalize_names(dict(model.named_parameters())).items() if name in wanted]
    if len(found) != len(names):  # renamed otherwise: they would train while meant to be frozen
        raise RuntimeError(f"--freeze: {len(found)} of its {len(names)} parameters found after prepare; please report")
    return found


def _units(accelerator: Accelerator, model: torch.nn.Module) -> list[str]:
    """Under FSDP2, the units the model is cut into, said in a note (`_cut`), and the accelerate config's auto-wrap
    policy checked where Accelerate 1.15 would stop with torch's traceback, in `prepare` or at the first forward pass:
    a unit that is a ModuleList or ModuleDict (torch's fully_shard takes modules with a forward only; SIZE_BASED_WRAP
    picks a model's `layers` list once it holds more than fsdp_min_num_params), a unit that holds the embedding, final
    norm or head (Accelerate then makes those units of their own, and torch refuses weights already in a unit), tied
    embeddings or head made a unit (torch refuses a weight in two units), and a layer class the model has none of."""
    if not (accelerator.is_fsdp2 and patches.tested("accelerate")):
        return []  # Accelerate's FSDP2 preparation, as mirrored here, was read in 1.15
    from accelerate.utils.fsdp_utils import _find_final_norm, fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.other import get_module_children_bottom_up
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    kind = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    blocks, given = getattr(model, "_no_split_modules", None) or [], plugin.transformer_cls_names_to_wrap
    classes = {type(module).__name__ for module in model.modules()}
    for name in (name for name in (given or blocks) if kind is transformer_auto_wrap_policy and name not in classes):
        raise ConfigError((f"the accelerate config's fsdp_transformer_layer_cls_to_wrap names {name}, and the model has "
                           "no module of that class" + (f" (its repeated block: {', '.join(blocks)})" if blocks else ""))
                          if given else f"the model's _no_split_modules names {name}, a class it has no module of")
    plugin.set_auto_wrap_policy(model)  # as Accelerate's prepare does (its second call changes nothing)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    units = [module for module in get_module_children_bottom_up(model)[:-1] if policy(module)] if policy else []
    embedding, head = (getattr(model, f"get_{side}_embeddings", lambda: None)() for side in ("input", "output"))
    weight = getattr(embedding, "weight", None)
    tied = weight is not None and weight is getattr(head, "weight", None)
    norm = _find_final_norm(model)
    cut = _cut(units, embedding, head, norm, tied, kind is transformer_auto_wrap_policy)
    if policy is None:
        return cut
    if kind is size_based_auto_wrap_policy:
        how = f"fsdp_auto_wrap_policy SIZE_BASED_WRAP (fsdp_min_num_params {plugin.min_num_params:,})"
        fix = ("use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, as accelerate_configs/fsdp.yaml does, with the "
               "model's repeated block in fsdp_transformer_layer_cls_to_wrap unless it is a transformers model")
    else:
        how = (f"fsdp_transformer_layer_cls_to_wrap ({', '.join(given)})" if given else
               f"fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP (the model's _no_split_modules: {', '.join(blocks)})")
        fix = "name the model's repeated block there" + (f" ({', '.join(blocks)}), or leave it out" if blocks else "")
    names = {id(module): name for name, module in model.named_modules()}
    for unit in units:
        if isinstance(unit, (torch.nn.ModuleList, torch.nn.ModuleDict)) and type(unit).forward is torch.nn.Module.forward:
            size = sum(p.numel() for p in unit.parameters())
            raise ConfigError(f"the accelerate config's {how} makes {names[id(unit)]} (a {type(unit).__name__} of "
                              f"{size:,} parameters) an FSDP2 unit, and torch's fully_shard takes only modules with a "
                              f"forward: {fix}")
    for unit in (m for m in (embedding, head) if tied and any(m is u for u in units)):
        raise ConfigError(f"the accelerate config's {how} makes {names[id(unit)]} ({type(unit).__name__}) an FSDP2 unit, "
                          "and its weight is tied to the embedding or the head: Accelerate keeps the two in one unit of "
                          f"its own, and torch refuses a weight in two units: {fix}")
    if plugin.ignored_modules is not None:
        return cut  # weights left out of every unit: those below may not be in the unit that holds them
    own = [m for m in (embedding, head, norm) if m is not None and next(m.parameters(), None) is not None]
    for unit in units:
        inside = [m for m in own if m is not unit and not any(m is u for u in units) and any(m is sub for sub in unit.modules())]
        if inside:
            raise ConfigError(f"the accelerate config's {how} makes {names[id(unit)]} ({type(unit).__name__}) an FSDP2 "
                              f"unit, and it holds {names[id(inside[0])]}, which Accelerate makes a unit of its own "
                              f"(the embedding, the final norm and the head are): {fix}")
    return cut


def _cut(units: list, embedding, head, norm, tied: bool, by_class: bool) -> list[str]:
    """The start line's note on FSDP2's units besides the root (which holds the rest): the policy's, then Accelerate's
    own (fsdp2_prepare_model): the embedding alone unless tied, then the final norm with the head (and the embedding,
    tied). Without a unit of the policy's, each forward pass gathers every block's weights at once."""
    free = [m is not None and not any(m is u for u in units) for m in (embedding, norm, head)]
    carved = ["the embedding"] if free[0] and not tied else []
    tail = [name for name, kept in zip(("the final norm", "the embedding", "the head"), (free[1], free[0] and tied, free[2]),
                                       strict=True) if kept]
    if tail:
        carved.append(tail[0] if len(tail) == 1 else f"{', '.join(tail[:-1])} and {tail[-1]} in one")
    counts = Counter(type(unit).__name__ for unit in units)
    total = len(units) + len(carved)
    if units:
        parts = "; ".join([f"{n} {name}" for name, n in counts.items()] + carved)
        return [f"FSDP2 cuts the model into {total} unit{'s' * (total != 1)} besides its root ({parts}), each gathered "
                "in its turn"]
    advice = ("name its repeated block in fsdp_transformer_layer_cls_to_wrap" if by_class else
              "use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with its repeated block in "
              "fsdp_transformer_layer_cls_to_wrap (a transformers model's _no_split_modules names it)")
    return [("FSDP2 cuts none of the model's blocks out (the accelerate config's auto-wrap policy picks none"
             + (f"; Accelerate's {total} unit{'s' * (total != 1)} besides the root: {'; '.join(carved)}" if carved else "")
             + f"), so each forward pass gathers all of their weights at once: {advice}")]
