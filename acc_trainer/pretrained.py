"""A Hugging Face transformers model's own files beside its weights: what `from_pretrained` needs.

A run folder, and each checkpoint, holds the weights as `model.safetensors` under the model's own names.
For a transformers model (a `PreTrainedModel`) the main process adds `config.json` and, for a model that
generates, `generation_config.json`: `AutoModelForCausalLM.from_pretrained(run_dir)` (or the model's own
class) then builds the trained model, ties its tied weights again (the safetensors file holds a tied
tensor once) and gives the same outputs. transformers is not imported: the model brought it.
"""

from __future__ import annotations

from pathlib import Path


def config_files(module, folder: Path) -> list[str]:
    """Writes a transformers model's config (and generation config) into `folder`; the names written."""
    config = getattr(module, "config", None)
    # A PEFT model's weights are the wrapped model's under other names: its own format is for another issue.
    if (not hasattr(module, "save_pretrained") or not hasattr(config, "save_pretrained")
            or hasattr(module, "peft_config")):
        return []
    config.architectures = [type(module).__name__]  # as save_pretrained records it: which class to build
    config.save_pretrained(folder)
    written = ["config.json"]
    generation = getattr(module, "generation_config", None)
    if generation is not None and module.can_generate():
        generation.save_pretrained(folder)
        written.append("generation_config.json")
    return written
