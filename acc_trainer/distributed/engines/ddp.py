"""Plain processes and DDP: every process holds the whole model. Checkpoints are Accelerate's own whole files
(`model.safetensors`, `optimizer.bin` with the optimizer's tensors numbered in its parameters' order), which any
number of processes reads; a checkpoint of a partly frozen model holds the tensors that train (`without_frozen`, a
`save_state` pre-hook). Whole files are what another engine's run reads too (`read_model`, `read_optimizer`): FSDP's
FULL_STATE_DICT files (`pytorch_model_fsdp.bin`) are read the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import Accelerator

from ...config import ConfigError
from .base import Engine, unwrapped_name

FULL_MODEL_FILES = ("model.safetensors", "pytorch_model_fsdp.bin")  # DDP's; FSDP's with FULL_STATE_DICT


class DDP(Engine):
    """Plain processes and DDP (the base's answers, and its whole files)."""

    def save_checkpoint(self, accelerator: Accelerator, folder: Path, trainable_only: bool) -> None:
        hook = accelerator.register_save_state_pre_hook(_trainable_only) if trainable_only else None
        try:
            super().save_checkpoint(accelerator, folder, trainable_only)
        finally:
            if hook is not None:
                hook.remove()

    def read_model(self, model, path: Path, trainable_only: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        whole = {unwrapped_name(name): tensor for name, tensor in whole_file(path, FULL_MODEL_FILES).items()}
        lacking = _lacking(model, whole.keys(), trainable_only)
        if lacking:
            more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
            raise ConfigError(f"checkpoint {path} lacks {len(lacking)} of the model's weights: {', '.join(lacking[:3])}{more}")
        # Not strict: a tied weight is held once and a partial checkpoint leaves the frozen ones out. What is missing is
        # found above: torch 2.14 reports nothing missing here (a weight left out keeps the values the model was built with).
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, strict=False))

    def read_optimizer(self, model, optimizer, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        saved = whole_file(path, ("optimizer.bin",))
        first = saved["param_groups"][0]["params"] if saved["param_groups"] else []
        if first and isinstance(first[0], int):  # numbered in the parameters' order, as DDP's optimizer.bin holds them
            saved = _by_name(model, optimizer, saved)
        set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))

    def whole_weights(self, path: Path) -> dict[str, torch.Tensor]:
        return dict(whole_file(path, FULL_MODEL_FILES))


def _trainable_only(models: list, weights: list, folder: str) -> None:
    """`save_state`'s pre-hook for a model with frozen parameters: the weights it writes, less the frozen ones."""
    weights[0] = without_frozen(models[0], weights[0])


def without_frozen(model, state: dict) -> dict:
    """`state` (the model's state dict) less the frozen parameters (tied names included): what a checkpoint keeps.
    An OrderedDict, as a state dict is: Accelerate then writes a tensor shared by two names (tied weights) once. A
    frozen 4-bit weight goes with its quantization state, which bitsandbytes writes beside it under its name
    (`...weight.absmax`, `...weight.quant_map`, `...weight.quant_state.bitsandbytes__nf4`)."""
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
    dropped = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.data_ptr() in frozen}
    return OrderedDict((k, v) for k, v in state.items() if k not in dropped and not _state_of(k, dropped))


def _state_of(key: str, weights: set) -> bool:
    """Whether `key` names a part of one of `weights` (a 4-bit weight's quantization state: `<weight>.absmax`)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in weights for i in range(1, len(parts)))


def _lacking(model, held: Iterable[str], partial: bool) -> list[str]:
    """The names in the model's state dict that a checkpoint holding `held` (names without `_orig_mod.`) has nothing
    for: a tied weight is held under either of its names; in a `partial` checkpoint the frozen parameters are not."""
    held = set(held)
    own = {unwrapped_name(name): tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad} if partial else set()
    loaded = {id(tensor) for name, tensor in own.items() if name in held}
    return [name for name, tensor in own.items() if id(tensor) not in loaded and id(tensor) not in frozen]


def _by_name(model, optimizer, saved: dict) -> dict:
    """A torch optimizer state dict (tensors numbered in the order of the parameters in its groups) keyed by the
    parameters' names instead: the numbers are this run's optimizer's order, which the same options build."""
    names = {id(p): unwrapped_name(name) for name, p in model.named_parameters()}  # as torch's functions name them
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(order) != sum(len(g["params"]) for g in saved["param_groups"]):
        raise ConfigError("the checkpoint's optimizer holds another number of parameters than this run's")
    return {"state": {order[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}


def whole_file(path: Path, names: tuple[str, ...]) -> dict:
    for name in names:
        file = path / name
        if file.is_file():
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, weights_only=True, map_location="cpu")
    raise ConfigError(f"checkpoint {path} is incomplete: none of {', '.join(names)} (nor pytorch_model_fsdp_0/)")
