"""A Hugging Face transformers model's own files beside its weights: what `from_pretrained` needs.

A run folder, and each checkpoint, holds the weights as `model.safetensors` under the model's own names.
For a transformers model (a `PreTrainedModel`) the main process adds `config.json` and, for a model that
generates, `generation_config.json`: `AutoModelForCausalLM.from_pretrained(run_dir)` (or the model's own
class) then builds the trained model, ties its tied weights again (the safetensors file holds a tied
tensor once) and gives the same outputs. transformers is not imported: the model brought it.

The run folder's README.md, its model card, is written here too (`model_card_file`, the text made by summary.py).

The run's tokenizer, when it has one (`--tokenizer`, `fit(tokenizer=)`, loaded by `load_tokenizer`), is saved
beside them with its own `save_pretrained` (`tokenizer_files`): `AutoTokenizer.from_pretrained(run_dir)` works.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from ..distributed import engines
from .adapters import is_peft, save_adapter

MODEL_CONFIG = "model-config"  # where a checkpoint of sharded weights keeps the model's config (config_files)


def config_files(module, folder: Path, whole: bool = True, adapter: dict | None = None, apart: bool = False) -> list[str]:
    """Writes a transformers model's config (and generation config) into `folder`, or a peft model's adapter in
    peft's format (`adapter`: its weights gathered whole, for a sharded model); the names written. `whole`: the
    folder's weights are all the model's (a checkpoint of a model with frozen parameters holds only those that train:
    no config.json then, which would load it half random). `apart`: the folder's weights are an engine's own files
    (FSDP's shards, DeepSpeed's), which from_pretrained cannot read: the config goes into `folder/model-config`, for
    `acc-trainer consolidate` to write beside the whole weights."""
    if is_peft(module):
        return save_adapter(module, folder, adapter)
    config = getattr(module, "config", None)
    if not whole or not hasattr(module, "save_pretrained") or not hasattr(config, "save_pretrained"):
        return []
    if apart:
        folder = folder / MODEL_CONFIG
        folder.mkdir(exist_ok=True)
    config = copy.deepcopy(config)  # the user's model keeps its own
    config.architectures = [class_name(module)]  # which class to build, as save_pretrained records it
    written = []
    try:
        config.save_pretrained(folder)
        written.append("config.json")
        generation = getattr(module, "generation_config", None)
        if generation is not None and module.can_generate():
            generation.save_pretrained(folder)
            written.append("generation_config.json")
    except (ValueError, TypeError) as e:  # transformers refuses a config it finds invalid: the weights still count
        for name in ("config.json", "generation_config.json"):
            (folder / name).unlink(missing_ok=True)
        print(f"acc-trainer: warning: {type(module).__name__}'s config was not written beside its weights in {folder} "
              f"(transformers: {str(e).splitlines()[0] if str(e) else type(e).__name__}); the weights were",
              file=sys.stderr)
        return []
    return [f"{MODEL_CONFIG}/{name}" for name in written] if apart else written


def class_name(module) -> str:
    """The model's class, as its config.json names it (FSDP2 renames the class: FSDPGPT2LMHeadModel)."""
    return engines.own_class(module).__name__


def model_card_file(module, folder: Path, card: str) -> None:
    """`card` as the model folder's README.md; for a peft model with peft's own part added, as peft adds it to the
    card of an adapter it saves (its library, base model, tags and version: `create_or_update_model_card`)."""
    (folder / "README.md").write_text(card)
    if is_peft(module):
        module.create_or_update_model_card(str(folder))


def tokenizer_files(tokenizer, folder: Path) -> list[str]:
    """Writes the run's tokenizer (None: there is none) into `folder` with its own `save_pretrained`: the folder
    then loads with `AutoTokenizer.from_pretrained` too. The names written."""
    if tokenizer is None:
        return []
    return sorted(Path(p).name for p in tokenizer.save_pretrained(str(folder)) if Path(p).is_file())


