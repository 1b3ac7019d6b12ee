"""LoRA adapters (through peft, an optional extra) and what a run whose model is partly frozen keeps.

`--lora R` wraps the model, after its starting weights are in place (its factory's, `--init-from`'s), in
peft's LoRA layers of rank R: only the adapters train. The run folder then holds the adapter in peft's own
format (`adapter_config.json`, `adapter_model.safetensors`: `PeftModel.from_pretrained(base, run_dir)`), and
with `--lora-merge` the merged model in `merged/` (`from_pretrained` for a transformers model).

With `--load-in-4bit` (QLoRA) the base is the --init-from folder's model in 4 bits (workload/quantized.py), or a
model given in 4 bits: checked and prepared as peft prepares a k-bit model (`base_in_4bit`, `apply_lora`).

A checkpoint of a model with frozen parameters (LoRA, `--freeze`) holds the parameters that train, every
buffer, the optimizer and the run's state, not the frozen weights (nor a 4-bit weight's quantization state): on
resume they are built again the way the run built them (the model's factory under the run's seed, `--init-from`
read again, the LoRA layers added), and a digest of them taken at the start of the run, kept in the checkpoint,
proves they are the same.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, TrainConfig, first_line
from ..distributed import engines
from ..distributed.engines.ddp import without_frozen
from ..distributed.engines.fsdp2 import found_again  # noqa: F401 - its old place (a test imports it here)
from ..workload import quantized
from ..workload.models import initial_weights, sync_batchnorm

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# peft's task types by the transformers class's name: a sequence classifier's new head then trains beside the adapters.
TASKS = (("ForCausalLM", "CAUSAL_LM"), ("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"),
         ("ForSeq2SeqLM", "SEQ_2_SEQ_LM"))


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "save_pretrained")


def apply_lora(cfg: TrainConfig, model):
    """The model wrapped in LoRA layers of rank --lora (peft's get_peft_model, which freezes the rest)."""
    try:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    except ImportError:
        raise ConfigError('--lora needs peft: pip install peft (or pip install -e ".[peft]")') from None
    if is_peft(model) or any(hasattr(m, "lora_A") for m in model.modules()):
        raise ConfigError(f"--lora: {type(model).__name__} already has LoRA layers (peft wraps the model it is given in "
                          "place): build the model afresh for each run")
    transformers_model = hasattr(model, "config") and hasattr(model, "save_pretrained")
    if cfg.lora_targets is None and not transformers_model:
        raise ConfigError(f"--lora on {type(model).__name__}: name the layers to adapt with --lora-targets (its layers: "
                          f"{_layer_names(model)})")
    targets = cfg.lora_targets or "all-linear"  # every linear layer but the output one (peft's all-linear)
    task = next((t for suffix, t in TASKS if type(model).__name__.endswith(suffix)), None)
    config = LoraConfig(r=cfg.lora, lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora,
                        lora_dropout=cfg.lora_dropout, target_modules=targets, task_type=task)
    try:
        with _old_names_quiet():
            if quantized.is_4bit(model):  # as peft prepares a k-bit base: every base weight frozen, norms in float32
                prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # --gradient-checkpointing's
            wrapped = get_peft_model(model, config)
        # get_peft_model records the model's own name_or_path (none for a model built from its config)
        for adapter in wrapped.peft_config.values():
            adapter.base_model_name_or_path = _base_folder(cfg) or adapter.base_model_name_or_path
        return wrapped
    except ValueError as e:
        if "not found in the base model" in str(e) or "No modules were targeted" in str(e):
            raise ConfigError(f"--lora-targets {','.join(cfg.lora_targets or [targets])}: no such layer in "
                              f"{type(model).__name__} (its layers: {_layer_names(model)})") from None
        raise ConfigError(f"--lora: {first_line(e)}") from None


def base_in_4bit(cfg: TrainConfig, model, job, engine: engines.Engine, out):
    """The model; when the run trains on a 4-bit base (--load-in-4bit, or a model given in 4 bits to fit()), checked
    (LoRA, DDP, the reference), with --init-from's report, the base's kind and memory, in `out` (the run's Tuning:
    summary.json's `init`, the start line's note). The command line's base was loaded in 4 bits where its workload was
    built (quantized.load); a model given to fit() that is not in 4 bits names the architecture, as a factory does."""
    if not (cfg.load_in_4bit or quantized.is_4bit(model)):
        return model
    if not quantized.is_4bit(model):
        model, job.init = quantized.load(cfg, lambda: model, job.model_name)
    engine.check_4bit()
    quantized.check(cfg, given=job.init is None)
    base = quantized.memory(model)
    out.init = {**(job.init or {"from": None, "loaded": 0, "reset": [], "missing": [], "unexpected": []}), "in_4bit": base}
    out.notes.append(quantized.note(job.init, base))
    return model


def _base_folder(cfg: TrainConfig) -> str | None:
    """Where the adapter's base model loads from (adapter_config.json's base_model_name_or_path, which
    AutoPeftModelForCausalLM.from_pretrained(run) reads): the --init-from folder that from_pretrained loads (a run's
    final folder, a model's), as an absolute path, never a name on the Hub; None for a base built from its config."""
    if cfg.init_from and (Path(cfg.init_from) / "config.json").is_file():
        return str(Path(cfg.init_from).resolve())
    return None


@contextmanager
def _old_names_quiet():
    """peft 0.21 asks transformers 5 by its old name whether checkpointing is on, which warns on every wrap."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


def _layer_names(model, limit: int = 12) -> str:
    """The names peft matches --lora-targets against (the last part of a layer's name), of layers it can adapt."""
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
    names = []
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if name and (isinstance(module, kinds) or type(module).__name__ == "Conv1D") and short not in names:
            names.append(short)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "") or "none"


def parameter_counts(model, frozen_for_now: list | None = None) -> dict:
    """How many parameters train now and how many there are (a tied weight counted once)."""
    paused = {id(p) for p in frozen_for_now or []}
    params = list(model.parameters())  # each Parameter once, tied ones too
    trainable = sum(_size(p) for p in params if p.requires_grad and id(p) not in paused)
    return {"trainable": trainable, "total": sum(_size(p) for p in params)}


def _size(p) -> int:
    """A parameter's number of elements; a ZeRO-3 partition's whole parameter's (DeepSpeed's ds_numel), a 4-bit
    weight's before it was packed (two to a byte)."""
    if type(p).__name__ == quantized.FOUR_BIT and getattr(p, "quant_state", None) is not None:
        return math.prod(p.quant_state.shape)
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()


def frozen_digest(model) -> dict | None:
    """sha256 of the frozen parameters (name, shape, bytes, in the model's order), and their count; None when
    everything trains."""
    digest, count = hashlib.sha256(), 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        tensor = p.detach().cpu().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        count += 1
    return {"parameters": count, "sha256": digest.hexdigest()} if count else None


def check_frozen(resume: Path, saved: dict | None, model) -> None:
    """The frozen weights built again for a resumed run are the ones the checkpoint's run trained beside."""
    here = frozen_digest(model)
    if saved != here:
        raise ConfigError(f"checkpoint {resume} holds only the parameters that train, and the frozen ones built again "
                          "differ from the ones it was trained with (" + (
                              f"digest {here['sha256'][:12]}..., the checkpoint's {saved['sha256'][:12]}..." if here and saved
                              else "other parameters are frozen") + "): the model's factory, its seed and --init-from must "
                          "give the same weights as when the run started")


def check_holds_trainable(resume: Path, model) -> None:
    """A checkpoint without every parameter that trains (an adapter lost on the way) is refused, naming one."""
    from safetensors import safe_open

    shards = resume / "pytorch_model_fsdp_0"  # FSDP's checkpoint of the model (torch's distributed checkpoint format)
    if shards.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        held = {k.removeprefix("model.") for k in FileSystemReader(str(shards)).read_metadata().state_dict_metadata}
        wanted = [n for n, p in model.named_parameters() if p.requires_grad and n not in held]
        if wanted:
            raise ConfigError(f"checkpoint {resume} lacks {len(wanted)} of the tensors that train (e.g. {wanted[0]})")
        return
    file = resume / "model.safetensors"
    if not file.is_file():
        raise ConfigError(f"checkpoint {resume} holds only the parameters that train, and no model.safetensors to check "
                          "them in")
    with safe_open(str(file), "pt") as f:
        held = set(f.keys())
    wanted, storages = without_frozen(model, model.state_dict()), {}
    for name, tensor in wanted.items():  # tied weights: the file holds one of the names that share a tensor
        storages.setdefault(tensor.data_ptr(), []).append(name)
    wanted = [names[0] for names in storages.values() if not any(n in held for n in names)]
    if wanted:
        raise ConfigError(f"checkpoint {resume} lacks {len(wanted)} of the tensors that train (e.g. {wanted[0]})")


def save_adapter(model, folder: Path, state: dict | None = None) -> list[str]:
    """A peft model's adapter in peft's format (`PeftModel.from_pretrained(base, folder)`); the names written.
    `state`: the model's weights gathered whole (`gathered_state`), for a model whose weights are sharded."""
    model.save_pretrained(str(folder), **({"state_dict": state} if state is not None else {}))
    (folder / "README.md").unlink(missing_ok=True)  # peft's model-card template: nothing of this run in it
    return [name for name in ADAPTER_FILES if (folder / name).exists()]


def gathered_state(model, whole: bool = False) -> dict | None:
    """Every process: a sharded (FSDP2) peft model's weights gathered whole on the main process (the adapter's, or
    with `whole` all of them, for --lora-merge); None for a model each process holds whole (or not a peft model)."""
    return engines.gathered(model, trainable_only=not whole) if is_peft(model) else None


def save_merged(model, folder: Path, state: dict | None = None) -> None:
    """--lora-merge: the adapters folded into a copy of the weights, saved as the base model saves itself
    (`from_pretrained` for a transformers model, else model.safetensors). The trained model is left as it is.
    `state`: the whole weights of a sharded model (`gathered_state(model, whole=True)`), put into a plain copy built
    from the transformers model's config (a sharded model cannot be copied)."""
    import copy

    from safetensors.torch import save_model

    merged = copy.deepcopy(model if state is None else _plain_copy(model, state)).merge_and_unload()
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(merged, "save_pretrained") and hasattr(getattr(merged, "config", None), "save_pretrained"):
        merged.save_pretrained(str(folder))
    else:
        save_model(merged, str(folder / "model.safetensors"))


def _plain_copy(model, state: dict):
    """A sharded transformers peft model built again, whole, on the main process's CPU, with `state` (its weights)."""
    import copy

    from peft import get_peft_model

    base = model.get_base_model()
    cls = engines.own_class(base)  # FSDP2 renames the class (FSDPLlamaForCausalLM)
    with _old_names_quiet():
        plain = get_peft_model(cls(copy.deepcopy(base.config)), copy.deepcopy(model.peft_config[model.active_adapter]))
    plain.load_state_dict(state)
    return plain


def check_merge_sharded(cfg: TrainConfig, model, engine: engines.Engine) -> None:
    """--lora-merge under FSDP (or DeepSpeed ZeRO-3) folds the adapters into a whole copy built from a transformers
    model's config: another model is refused at start, in one line."""
    sharded = engine.weights_sharded_by()
    if cfg.lora_merge and sharded and not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise ConfigError(f"--lora-merge under {sharded} needs a transformers model (the merged copy is built again from "
                          f"its config, as sharded weights cannot be copied); {type(model).__name__} is not one: merge "
                          "the finished run's adapter into your model with peft's merge_and_unload")


def load_adapter(base, folder: Path):
    """A LoRA run's adapter (`folder`: a run folder or checkpoint) on `base`, the model built as the run built it."""
    from peft import PeftModel

    try:
        with _old_names_quiet():
            return PeftModel.from_pretrained(base, str(folder))
    except Exception as e:  # noqa: BLE001 - an adapter that does not fit the model given is the user's input
        raise ConfigError(f"the adapter in {folder} does not load into {type(base).__name__}: {first_line(e)}") from None


@dataclass
class Tuning:
    """The model as it trains: --init-from's report, --freeze's parameters and norm layers (`starting_weights`, `freeze`),
    and what the start line says of them."""

    init: dict | None = None
    frozen: list = field(default_factory=list)  # parameters frozen until --unfreeze-at (or for good)
    frozen_names: set = field(default_factory=set)  # their names, which `prepare` keeps (the engine's `after_prepare`)
    frozen_norms: list = field(default_factory=list)  # BatchNorm layers whose parameters are all frozen
    notes: list[str] = field(default_factory=list)
    shapes: dict = field(default_factory=dict)  # the parameters' shapes as the user built them (with the adapters)
    flops: float = 0  # per training sample, counted by the main process
    digest: dict | None = None  # the frozen weights' digest, when checkpoints hold only what trains


def starting_weights(cfg: TrainConfig, model, resumed: dict | None, engine: engines.Engine, job) -> tuple:
    """(the model, its Tuning): --init-from's weights (not when resuming from a checkpoint that holds them all),
    then --lora's adapters around them (adapters.py)."""
    out = Tuning()
    model = base_in_4bit(cfg, model, job, engine, out)  # a 4-bit base holds --init-from's weights already
    if out.init is None and cfg.init_from and (not resumed or resumed.get("frozen")):
        report = initial_weights(model, cfg.init_from, cfg.init_strict)
        out.init = report
        out.notes.append(f"init from {cfg.init_from}: {report['loaded']} tensors loaded" + "".join(
            f", {len(report[k])} {k} ({', '.join(report[k][:3])}{', ...' if len(report[k]) > 3 else ''})"
            for k in ("reset", "missing", "unexpected") if report[k]))
    if cfg.lora:
        check_merge_sharded(cfg, model, engine)
        model = apply_lora(cfg, model)
        counts = parameter_counts(model)
        out.notes.append(f"LoRA rank {cfg.lora} on {cfg.lora_targets and ','.join(cfg.lora_targets) or 'every linear layer'}"
                         f": {counts['trainable']:,} of {counts['total']:,} parameters train "
                         f"({100 * counts['trainable'] / counts['total']:.2f}%)")
    return model, out


def as_it_trains(cfg: TrainConfig, model, out: Tuning, device_type: str):
    """The model once its starting weights are in, as it will train: BatchNorm made collective (--sync-bn), channels
    last, --freeze (after the conversions: the frozen norm layers are the ones that train), gradient checkpointing
    (through the adapters, onto the base's blocks)."""
    if cfg.sync_bn:
        model = sync_batchnorm(model, device_type)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    freeze(cfg, model, out)
    if cfg.gradient_checkpointing:
        gradient_checkpointing(model)
    return model


def frozen_checked(model, resume, resumed: dict | None) -> dict | None:
    """The digest of the frozen weights (checkpoints keep the trainable ones), checked against a resumed run's."""
    frozen = frozen_digest(model)
    if resumed and resumed.get("frozen"):
        check_frozen(resume, resumed["frozen"], model)
    return frozen


def gradient_checkpointing(model) -> None:
    """--gradient-checkpointing through a transformers model's own switch, non-reentrant: the reentrant form
    recomputes under DDP's hooks a second time and needs inputs that require gradients (frozen embeddings,
    LoRA). A module of one's own has no switch: it calls torch.utils.checkpoint in its forward."""
    # transformers 5 renamed the switch (the old name warns); earlier versions have only the old one.
    if hasattr(model, "activation_checkpointing_enable"):
        enable = lambda: model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        enable = lambda: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        own = model.get_base_model() if is_peft(model) else model  # the user's model, not peft's wrapper
        raise ConfigError(f"--gradient-checkpointing: {type(own).__name__} has no gradient_checkpointing_enable "
                          "(transformers models have); in a module of your own, call torch.utils.checkpoint."
                          "checkpoint(block, x, use_reentrant=False) in its forward instead")
    try:
        enable()
    except ValueError as e:  # a transformers model that does not support it says so
        raise ConfigError(f"--gradient-checkpointing: {first_line(e)}") from None


def freeze(cfg: TrainConfig, model, out) -> None:
    """--freeze. Parameters frozen for good stop needing gradients (DDP then leaves them out); ones that
    --unfreeze-at will train keep theirs, and their gradients are dropped before each step until then (so DDP
    syncs the same parameters all run, and an optimizer with weight decay leaves them untouched). BatchNorm
    layers whose parameters are all frozen keep their running statistics (evaluation mode while frozen). `out`: the
    run's Tuning (training/setup.py), given the frozen parameters, their names and norm layers, and the note."""
    if cfg.freeze:
        if cfg.unfreeze_at is not None and engines.requested().keeps_gradients:
            raise ConfigError("--unfreeze-at: DeepSpeed steps its optimizer inside the backward pass, before frozen "
                              "gradients can be dropped; use DDP or FSDP, or --freeze alone")
        pattern = re.compile(cfg.freeze)
        names = {name for name, _ in model.named_parameters() if pattern.search(name)}
        if not names:
            raise ConfigError(f"--freeze {cfg.freeze!r} matches no parameter (names such as "
                              f"{next(iter(dict(model.named_parameters())), '-')!r})")
        out.frozen, out.frozen_names = [p for name, p in model.named_parameters() if name in names], names
        for p in out.frozen:
            p.requires_grad_(cfg.unfreeze_at is not None)
        frozen = {id(p) for p in out.frozen}
        out.frozen_norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
                            and any(True for _ in m.parameters()) and all(id(p) in frozen for p in m.parameters())]
        out.notes.append(f"frozen: {len(names)} parameters matching {cfg.freeze!r}"
                         + (f", trained from epoch {cfg.unfreeze_at}" if cfg.unfreeze_at else ""))
