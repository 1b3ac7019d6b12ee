"""4-bit bases (`--load-in-4bit`, QLoRA): a transformers model loaded from its `from_pretrained` folder (--init-from)
through transformers' BitsAndBytesConfig, its linear layers' weights packed in 4 bits (nf4 or fp4, bitsandbytes'
Params4bit) and computed in --bnb-4bit-compute-dtype; LoRA adapters train on it, the base frozen (language/adapters.py).

The run's model factory names the architecture: it is called on the meta device (no weights are made, whatever the
model's size), and its class and config load the folder's weights in 4 bits (`cls.from_pretrained(init_from,
config=..., quantization_config=...)`): a causal LM, or the sequence classifier of --objective reward, as the factory
builds it. A model its user loaded in 4 bits (given to fit()) is recognised by `is_4bit` and trains the same way.

bitsandbytes (with transformers and peft: the `qlora` extra) is imported here only, and only for --load-in-4bit.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..config import ConfigError, TrainConfig, first_line

FOUR_BIT = "Params4bit"  # bitsandbytes' class of a 4-bit weight: packed bytes, its quantization state beside them


def is_4bit(model: nn.Module) -> bool:
    """Whether the model (peft's or DDP's wrapper around it too) holds 4-bit weights of bitsandbytes."""
    return any(type(p).__name__ == FOUR_BIT for p in model.parameters())


def steady(model: nn.Module) -> nn.Module:
    """The 4-bit layers kept as they were loaded. bitsandbytes 0.50, on a CPU with AVX512-BF16, repacks a layer's
    weights in place at its first forward in evaluation mode (for its faster kernel, the scales rounded to bfloat16;
    it fails on a layer narrower than its blocks of 64) and packs them back, rounded, whenever the state dict is read:
    the frozen base would change under the run at its first evaluation and at each checkpoint, and a resumed run would
    differ. Switched off, training and evaluation compute through the same dequantization, on every machine."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    return model


def check(cfg: TrainConfig, given: bool = False) -> None:
    """What a 4-bit base trains with, one line for what else: LoRA adapters (the base is frozen), DPO's and GRPO's
    reference the model with its adapters off, no merge. `given`: the model was given in 4 bits (fit())."""
    what = "a model given in 4 bits" if given and not cfg.load_in_4bit else "--load-in-4bit"
    if cfg.lora is None:
        raise ConfigError(f"{what} trains LoRA adapters on the frozen 4-bit base: give --lora RANK")
    if cfg.dpo_reference == "copy":
        raise ConfigError(f"--dpo-reference copy with {what}: the reference is the model with its LoRA adapters off "
                          "(--dpo-reference adapter, the default with --lora), never a second copy of a 4-bit model")
    if cfg.lora_merge:
        raise ConfigError(f"--lora-merge with {what}: merged into the 4-bit weights the adapters would be rounded to 4 bits; "
                          "merge the run's adapter into the base in its own dtype (peft's merge_and_unload)")
    if given and cfg.init_from and not cfg.load_in_4bit:
        raise ConfigError("--init-from loads weights into the model, which is given in 4 bits already: leave it out, "
                          "or give load_in_4bit=True to say the model is that folder's in 4 bits")


def bnb_config(cfg: TrainConfig):
    """transformers' BitsAndBytesConfig of the run; one line when bitsandbytes (or transformers) is missing."""
    with _quiet("bitsandbytes"):  # a CPU with AVX512-BF16 looks for an optional kernel package, and warns without it
        try:
            import bitsandbytes  # noqa: F401 - transformers imports it again to quantize
            from transformers import BitsAndBytesConfig
        except ImportError as e:
            raise ConfigError(f'--load-in-4bit needs bitsandbytes and transformers: pip install -e ".[qlora]" '
                              f"({first_line(e)})") from None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
                              bnb_4bit_compute_dtype=getattr(torch, cfg.bnb_4bit_compute_dtype))


def load(cfg: TrainConfig, architecture: Callable[[], nn.Module], name: str) -> tuple[nn.Module, dict]:
    """The --init-from folder's model in 4 bits, of the class and config `architecture()` (the run's model factory, here
    called on the meta device, or a model given to fit() that is not in 4 bits) builds; with --init-from's report."""
    check(cfg)
    quantization = bnb_config(cfg)
    folder = Path(cfg.init_from or "")
    if not cfg.init_from or not (folder / "config.json").is_file():
        raise ConfigError(f"--load-in-4bit loads the --init-from folder with from_pretrained (config.json and the "
                          f"weights); {cfg.init_from or 'no --init-from'} is not such a folder")
    with torch.device("meta"):
        model = architecture()
    if not (hasattr(type(model), "from_pretrained") and hasattr(getattr(model, "config", None), "to_dict")):
        raise ConfigError(f"--load-in-4bit loads a transformers model (from_pretrained); {name} builds "
                          f"{type(model).__name__}, which is not one")
    cls = type(model)
    device = int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.is_available() and not cfg.cpu else None
    try:
        with _quiet("transformers"):
            loaded, info = cls.from_pretrained(str(folder), config=copy.deepcopy(model.config), output_loading_info=True,
                                               quantization_config=quantization,
                                               **({"device_map": {"": device}} if device is not None else {}))
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"--init-from {folder} does not load as {cls.__name__} in 4 bits: {first_line(e)}") from None
    steady(loaded)
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    if cfg.init_strict and (missing or unexpected or mismatched):
        first = (missing or unexpected or mismatched)[0]
        raise ConfigError(f"--init-from {folder} does not match {cls.__name__} exactly (--init-strict): {len(mismatched)} "
                          f"of another shape, {len(missing)} missing, {len(unexpected)} unexpected; first: {first}")
    loaded_count = len({n for n, _ in loaded.named_parameters()} - set(missing) - set(mismatched))
    report = {"from": str(folder), "loaded": loaded_count, "reset": mismatched, "missing": missing,
              "unexpected": unexpected}
    return loaded, report


def memory(model: nn.Module) -> dict:
    """A 4-bit base as it is: its kind (nf4, fp4) and compute dtype, and its weights' memory in 4 bits (the packed
    bytes and their quantization state; the layers bitsandbytes leaves whole, such as the embeddings, as they are)
    against what the same weights take in their own dtype."""
    held = whole = 0
    kind = dtype = None
    for p in model.parameters():  # each Parameter once, tied ones too
        size = p.numel() * p.element_size()
        state = getattr(p, "quant_state", None) if type(p).__name__ == FOUR_BIT else None
        if state is None:
            held, whole = held + size, whole + size
            continue
        held += size + sum(t.numel() * t.element_size() for t in state.as_dict(packed=True).values()
                           if isinstance(t, torch.Tensor))
        whole += math.prod(state.shape) * state.dtype.itemsize
        kind, dtype = state.quant_type, state.dtype
    compute = next((m.compute_dtype for m in model.modules() if getattr(m, "compute_dtype", None) is not None), None)
    return {"quant_type": kind, "compute_dtype": _name(compute), "bytes": held, "bytes_unquantized": whole,
            "dtype": _name(dtype)}


def note(init: dict | None, base: dict) -> str:
    """The start line's note on a 4-bit base (`base`: `memory`'s), loaded from --init-from (`init`: its report) or
    given so."""
    how = f"{base['quant_type']}, computed in {base['compute_dtype']}"
    source = f"the model given is loaded in 4 bits ({how}): "
    if init:  # as --init-from's note without 4 bits: what did not load (a reward model's new head: missing)
        source = f"init from {init['from']} in 4 bits ({how}): {init['loaded']} tensors loaded" + "".join(
            f", {len(init[k])} {k} ({', '.join(init[k][:3])}{', ...' if len(init[k]) > 3 else ''})"
            for k in ("reset", "missing", "unexpected") if init[k]) + "; "
    held, whole = base["bytes"], base["bytes_unquantized"]
    return f"{source}the base takes {readable(held)} in 4 bits, {readable(whole)} in {base['dtype']} ({whole / held:.1f}x)"


def _name(dtype) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def readable(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


@contextmanager
def _quiet(library: str):
    """bitsandbytes' import warning of an optional kernel package (on CPUs with AVX512-BF16), or transformers' loading
    bar and its notes, left out of the start line; both as they were afterwards."""
    if library == "bitsandbytes":
        logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)
        return
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
