"""FSDP and DeepSpeed, the engines an accelerate config can select, and the gaps Accelerate 1.15
leaves around them that would otherwise break a run or quietly train something else.

`accelerate launch --config_file accelerate_configs/fsdp.yaml` (or deepspeed.yaml) tells the
processes through ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED; Accelerate then prepares the model
with its own FSDP2 or DeepSpeed code. What is here makes that hold on CPU processes too (FSDP2 over
gloo; DeepSpeed as one CPU process) and turns every setup Accelerate would mishandle into one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

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


def check_4bit(engine: str) -> None:
    """A 4-bit base (--load-in-4bit's, or a model given in 4 bits) trains under DDP: one line, before the first step,
    for an engine that cannot hold one."""
    if engine in ("FSDP", "DEEPSPEED"):
        raise ConfigError(f"the accelerate config selects {'FSDP' if engine == 'FSDP' else 'DeepSpeed'}, which cannot hold "
                          "a 4-bit base (it would shard or flatten bitsandbytes' packed weights apart from their "
                          "quantization state): train --load-in-4bit under DDP (--multi_gpu, or accelerate_configs/"
                          "cpu_ddp.yaml)")


def check_deepspeed(cfg: TrainConfig) -> None:
    """Checked before the process group exists: Accelerate would fail inside its setup, or quietly
    train something else."""
    if cfg.load_in_4bit:
        check_4bit("DEEPSPEED")
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


def check_fsdp(cfg: TrainConfig) -> None:
    """Checked before the process group exists: FSDP setups that cannot run on these processes, one line each."""
    if cfg.load_in_4bit:
        check_4bit("FSDP")
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
    # A second run in the same processes (a second fit()) finds FSDP in the processes' state and no plugin yet.
    if engine == "FSDP" and accelerator.device.type == "cpu" and accelerator.num_processes > 1 and (
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
    if engine != "DDP" and accelerator.distributed_type != DistributedType[engine]:
        raise ConfigError(f"the accelerate config selects {engine} but Accelerate set up "
                          f"{accelerator.distributed_type.value} on {accelerator.device.type}; start the "
                          "processes with accelerate launch --config_file accelerate_configs/...")


def deepspeed_plugin(cfg: TrainConfig) -> DeepSpeedPlugin:
    """The trainer's --grad-accum and --max-grad-norm, whatever the config (Accelerate 1.15 leaves gradient_clipping
    out for 0, and DeepSpeed 0.19 then clips at its default, 1.0: a run without --max-grad-norm was clipped), and ZeRO-3
    made to gather the whole weights for the final save (`get_state_dict` refuses otherwise, after the training)."""
    plugin = DeepSpeedPlugin(gradient_accumulation_steps=cfg.grad_accum, gradient_clipping=cfg.max_grad_norm or 0.0)
    config = plugin.deepspeed_config
    config["gradient_accumulation_steps"] = cfg.grad_accum  # a config file without one would have 1 (Accelerate)
    config["gradient_clipping"] = cfg.max_grad_norm or 0.0
    if plugin.zero_stage == 3:  # stage3_gather_16bit_weights_on_model_save, whatever zero3_save_16bit_model says
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return plugin


def before_prepare(accelerator: Accelerator, model: torch.nn.Module,
                   per_process_batch: int) -> tuple[torch.dtype | None, list[str]]:
    """Before `prepare`: FSDP2's units checked (`_units`), DeepSpeed told the batch; returns the dtype batches must
    have (None: as they are) and the start line's note on FSDP2's units.

    The training loader's batches come from a batch sampler, so DeepSpeed is told the per-process
    batch; and its bf16/fp16 casts the weights themselves (no autocast), so batches are cast to match.
    """
    notes = _units(accelerator, model)
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None, notes
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = per_process_batch
    config["train_batch_size"] = per_process_batch * config["gradient_accumulation_steps"] * accelerator.num_processes
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision), notes


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


def zero_stage() -> int:
    """The ZeRO stage the accelerate config asks DeepSpeed for, as Accelerate's DeepSpeedPlugin reads it (a DeepSpeed
    config file's, else the launcher's, else 2); meaningful where the config selects DeepSpeed (`requested`)."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    stage = json.loads(Path(path).read_text()).get("zero_optimization", {}).get("stage") if path != "none" else None
    return int(stage if stage not in (None, "auto") else os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))


def save_state_dict(state: dict, module, folder: Path) -> None:
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


def partitioned(model) -> bool:
    """The model's parameters are ZeRO-3 partitions (DeepSpeed gives them ds_id and ds_numel)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


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
