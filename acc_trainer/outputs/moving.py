"""A checkpoint continued under another engine than the one that wrote it: DDP (or one process) and FSDP2.

`accelerator.load_state` reads a checkpoint in the form its own engine wrote it: DDP's `model.safetensors` and
`optimizer.bin` (the optimizer's tensors numbered in its parameters' order), FSDP's `pytorch_model_fsdp_0/` and
`optimizer_0/` (torch's distributed checkpoint format, one file per process; or with FULL_STATE_DICT
`pytorch_model_fsdp.bin` and `optimizer.bin`, whole tensors keyed by parameter name). Between two numbers of
processes under one engine it needs no help: DDP's files are whole, and the distributed checkpoint format
reshards on load. Between engines, what is here loads the weights and the optimizer state through torch's
state-dict functions (`set_model_state_dict`, `set_optimizer_state_dict`), which take whole tensors keyed by
parameter name and put each process's part in place for a plain, a DDP or an FSDP2 model alike; a distributed
checkpoint is read straight into the model's own (sharded or whole) tensors. The LR schedule is `scheduler.bin`
under every engine; the random states are restored by the caller (checkpoints.check_random_states).

DeepSpeed keeps its own format (ZeRO partitions of flattened tensors): it continues under DeepSpeed only, and
`acc-trainer consolidate` turns its checkpoint into whole weights (a new run starts from them with --init-from).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import Accelerator

from ..config import ConfigError

SHARDED_MODEL, SHARDED_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"  # FSDP's distributed checkpoint
FULL_MODEL_FILES = ("model.safetensors", "pytorch_model_fsdp.bin")  # DDP's; FSDP's with FULL_STATE_DICT
DEEPSPEED_MODEL = "pytorch_model"  # DeepSpeed's checkpoint tag under Accelerate: its folder in the checkpoint
COMPILED = "_orig_mod"  # torch.compile's wrapper: the module it holds, a segment of its parameters' names


def crosses_engines(saved_engine: str, engine: str) -> bool:
    """The checkpoint was written under another engine than this run's (DDP and one process count as one)."""
    return saved_engine != engine


def check_move(path: Path, saved_engine: str, saved_world: int, engine: str, world: int) -> None:
    """The moves that are supported (DDP <-> FSDP, any number of processes), or one line saying what converts it."""
    if "DEEPSPEED" in (saved_engine, engine) and (saved_engine != engine or saved_world != world):
        raise ConfigError(
            f"checkpoint {path} was written by {saved_world} process(es) under {saved_engine}, and this run is "
            f"{world} under {engine}: DeepSpeed's checkpoints continue under DeepSpeed with the same number of processes "
            f"only (its files are ZeRO partitions of flattened tensors). Its weights go elsewhere with `acc-trainer "
            f"consolidate {path} OUT`, then --init-from OUT (a new run from those weights, without the optimizer state)")


def load(accelerator: Accelerator, model, optimizer, scheduler, path: Path, partial: bool) -> None:
    """The checkpoint's weights, optimizer state and schedule into this run's prepared objects (every process).
    `partial`: the checkpoint holds only the parameters that train (the frozen ones were built again)."""
    if accelerator._custom_objects:
        raise ConfigError(f"checkpoint {path}: --ema's average continues under the engine that wrote the checkpoint "
                          "only; resume it there")
    model = accelerator.unwrap_model(model, keep_torch_compile=False) if not accelerator.is_fsdp2 else model
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper: torch's optimizer inside
    _load_model(model, path, partial)
    _load_optimizer(model, optimizer, path)
    scheduler.load_state_dict(torch.load(path / "scheduler.bin", weights_only=True))
    if accelerator.scaler is not None and (path / "scaler.pt").is_file():
        accelerator.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
    accelerator.wait_for_everyone()


def _load_model(model, path: Path, partial: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if (path / SHARDED_MODEL).is_dir():  # read into the model's own tensors, resharded as they are now
        options = StateDictOptions(ignore_frozen_params=partial, strict=not partial)
        state = get_model_state_dict(model, options=options)
        if partial:  # a frozen tied weight's other name too (torch drops the first name only), as it was saved
            frozen = {_unwrapped_name(name) for name, p in model.named_parameters(remove_duplicate=False)
                      if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        state = {"model": state}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / SHARDED_MODEL)), no_dist=_one_process())
        set_model_state_dict(model, state["model"], options=options)
        return
    whole = {_unwrapped_name(name): tensor for name, tensor in _whole_file(path, FULL_MODEL_FILES).items()}
    lacking = _lacking(model, whole.keys(), partial)
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise ConfigError(f"checkpoint {path} lacks {len(lacking)} of the model's weights: {', '.join(lacking[:3])}{more}")
    # Not strict: a tied weight is held once and a partial checkpoint leaves the frozen ones out. What is missing is
    # found above: torch 2.14 reports nothing missing here (a weight left out keeps the values the model was built with).
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, strict=False))


def _lacking(model, held: Iterable[str], partial: bool) -> list[str]:
    """The names in the model's state dict that a checkpoint holding `held` (names without `_orig_mod.`) has nothing
    for: a tied weight is held under either of its names; in a `partial` checkpoint the frozen parameters are not."""
    held = set(held)
    own = {_unwrapped_name(name): tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad} if partial else set()
    loaded = {id(tensor) for name, tensor in own.items() if name in held}
    return [name for name, tensor in own.items() if id(tensor) not in loaded and id(tensor) not in frozen]


def _unwrapped_name(name: str) -> str:
    """A parameter's name without torch.compile's `_orig_mod` segments (a compiled model's, or a compiled block's:
    `_orig_mod.model.layers.0.mlp.up_proj.weight`, `model.layers.0._orig_mod.mlp.up_proj.weight`), as torch's
    state-dict functions name it and as a checkpoint of an uncompiled model holds it."""
    return ".".join(part for part in name.split(".") if part != COMPILED)


def _load_optimizer(model, optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    if (path / SHARDED_OPTIMIZER).is_dir():
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / SHARDED_OPTIMIZER)), no_dist=_one_process())
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return
    saved = _whole_file(path, ("optimizer.bin",))
    if saved["param_groups"] and saved["param_groups"][0]["params"] and isinstance(saved["param_groups"][0]["params"][0], int):
        saved = _by_name(model, optimizer, saved)
    set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))


def _by_name(model, optimizer, saved: dict) -> dict:
    """A torch optimizer state dict (tensors numbered in the order of the parameters in its groups) keyed by the
    parameters' names instead: the numbers are this run's optimizer's order, which the same options build."""
    names = {id(p): _unwrapped_name(name) for name, p in model.named_parameters()}  # as torch's functions name them
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(order) != sum(len(g["params"]) for g in saved["param_groups"]):
        raise ConfigError("the checkpoint's optimizer holds another number of parameters than this run's")
    return {"state": {order[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}


def _one_process() -> bool:
    """No process group (a run of one process): the distributed checkpoint is read by this process alone."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _whole_file(path: Path, names: tuple[str, ...]) -> dict:
    for name in names:
        file = path / name
        if file.is_file():
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, weights_only=True, map_location="cpu")
    raise ConfigError(f"checkpoint {path} is incomplete: none of {', '.join(names)} (nor {SHARDED_MODEL}/)")


def whole_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights, whole tensors by parameter name, on the CPU of this one process, whichever engine
    wrote them (DDP's model.safetensors, FSDP's distributed checkpoint or its FULL_STATE_DICT file, DeepSpeed's ZeRO
    partitions through DeepSpeed's own zero_to_fp32): what `acc-trainer consolidate` writes."""
    if (path / SHARDED_MODEL).is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = dcp.FileSystemReader(str(path / SHARDED_MODEL))
        held = reader.read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in held.items()
                 if isinstance(m, TensorStorageMetadata)}
        with warnings.catch_warnings():  # torch says it reads in one process, which is what no_dist asks
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)  # every shard, read into whole tensors
        return {k.removeprefix("model."): v for k, v in state.items()}  # Accelerate saves {"model": state dict}
    if (path / DEEPSPEED_MODEL).is_dir():
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise ConfigError(f"checkpoint {path} was written by DeepSpeed, whose files only DeepSpeed reads: "
                              'pip install -e ".[deepspeed]"') from None
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_MODEL))
    return dict(_whole_file(path, FULL_MODEL_FILES))
