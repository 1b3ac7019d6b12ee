"""A Hugging Face transformers model's own files beside its weights: what `from_pretrained` needs.

A run folder, and each checkpoint, holds the weights as `model.safetensors` under the model's own names.
For a transformers model (a `PreTrainedModel`) the main process adds `config.json` and, for a model that
generates, `generation_config.json`: `AutoModelForCausalLM.from_pretrained(run_dir)` (or the model's own
class) then builds the trained model, ties its tied weights again (the safetensors file holds a tied
tensor once) and gives the same outputs. transformers is not imported: the model brought it.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path


def config_files(module, folder: Path) -> list[str]:
    """Writes a transformers model's config (and generation config) into `folder`; the names written."""
    config = getattr(module, "config", None)
    # A PEFT model's weights are the wrapped model's under other names: its own format is for another issue.
    if (not hasattr(module, "save_pretrained") or not hasattr(config, "save_pretrained")
            or hasattr(module, "peft_config")):
        return []
    config = copy.deepcopy(config)  # the user's model keeps its own
    # Which class to build, as save_pretrained records it (FSDP2 renames the class: FSDPGPT2LMHeadModel).
    config.architectures = [next(c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))]
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
    return written
