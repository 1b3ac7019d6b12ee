"""`acc-trainer consolidate CHECKPOINT OUT`: a checkpoint's weights as a model folder the usual tools load.

A checkpoint of DDP holds `model.safetensors`; one of FSDP holds each process's shard in torch's distributed
checkpoint format, and one of DeepSpeed its ZeRO partitions: neither is a file `from_pretrained`, safetensors or
`acc_trainer.evaluate(..., weights=)` reads, so those checkpoints keep a transformers model's config apart, in
`model-config/`, where it promises nothing. This writes OUT/model.safetensors, the whole weights exactly as they
were in training (bit for bit), with that config and the run's tokenizer beside them: OUT then loads with
`AutoModelForCausalLM.from_pretrained(OUT)` (a transformers model) and `evaluate(model, data, weights=OUT/...)`.

    acc-trainer consolidate runs/llama/checkpoints/step-00000500 runs/llama-step500
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from ..config import ConfigError
from ..distributed.engines import whole_weights
from ..flags import Parser
from ..language.pretrained import MODEL_CONFIG
from ..outputs.checkpoints import STATE_FILE, damage, unverified, write_sums

CONFIGS = ("config.json", "generation_config.json")  # a transformers model's, beside whole weights
# The files a tokenizer's save_pretrained writes, kept beside the weights.
TOKENIZER_FILE = re.compile(r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|.*\.model|"
                            r"chat_template\..*)$")


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, accept_unverified: bool = False) -> dict:
    """Writes `checkpoint`'s whole weights into the folder `out` (which must not exist, or be empty) as
    model.safetensors, with the model's config and tokenizer; returns what was written (files, tensors, engine)."""
    checkpoint, out = Path(checkpoint), Path(out)
    state = _trainer_state(checkpoint)
    note = unverified(f"checkpoint {checkpoint}", damage(checkpoint), accept_unverified)  # raises when damaged
    if note:
        print(f"acc-trainer: {note}", file=sys.stderr)
    if state.get("frozen"):
        adapter = (checkpoint / "adapter_model.safetensors").is_file()
        raise ConfigError(f"checkpoint {checkpoint} holds only the parameters that train (the frozen ones are built "
                          "again when the run resumes): " + (
                              "its adapter is in peft's format in it already: PeftModel.from_pretrained(base, "
                              f"'{checkpoint}')" if adapter else "the run folder's final model.safetensors is whole"))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder: nothing is written over it")
    whole = whole_weights(checkpoint)
    parameters = _parameter_count(state, whole)
    weights = _unshared(whole)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = checkpoint / MODEL_CONFIG  # a sharded checkpoint's; a whole one's is beside its weights
    extra = [p for p in (config.iterdir() if config.is_dir() else []) if p.is_file()]
    extra += [p for p in checkpoint.iterdir() if p.is_file() and (TOKENIZER_FILE.match(p.name) or p.name in CONFIGS)]
    for file in extra:
        shutil.copy2(file, tmp / file.name)
    names = sorted(p.name for p in tmp.iterdir())
    write_sums(tmp, names)  # before the folder is in place: a kill in between leaves no folder that reads as unverifiable
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return {"files": names, "tensors": len(weights), "engine": state.get("engine", "DDP"), "step": state.get("step"),
            "parameters": parameters}


def _trainer_state(checkpoint: Path) -> dict:
    if not (checkpoint / STATE_FILE).is_file():
        raise ConfigError(f"{checkpoint} is not an acc_trainer checkpoint (no {STATE_FILE}); checkpoints are the folders "
                          "in RUN_DIR/checkpoints/")
    try:
        return json.loads((checkpoint / STATE_FILE).read_text())
    except ValueError as e:
        raise ConfigError(f"checkpoint {checkpoint / STATE_FILE} is corrupt ({e})") from None


def _parameter_count(state: dict, weights: dict) -> int:
    """The model's parameters, a tied weight once: from the shapes the checkpoint recorded of the model's parameters
    (FSDP's shards name a tied tensor twice, read as two tensors), or, in a checkpoint from before those were recorded,
    from the distinct tensors read (DeepSpeed's reader gives a tied one under both names)."""
    shapes = state.get("parameters")
    if shapes:
        return sum(math.prod(shape) for shape in shapes.values())
    return sum({id(t): t.numel() for t in weights.values()}.values())


def _unshared(weights: dict) -> dict:
    """safetensors writes no two names sharing one tensor (tied weights, as DeepSpeed's reader returns them): each
    name its own contiguous tensor."""
    seen, out = set(), {}
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu()
        out[name] = tensor.clone().contiguous() if tensor.data_ptr() in seen else tensor.contiguous()
        seen.add(tensor.data_ptr())
    return out


def main(argv: list[str]) -> None:
    parser = Parser(prog="acc-trainer consolidate",
                                     description="Write a checkpoint's whole weights (any engine: DDP, FSDP's shards, "
                                                 "DeepSpeed's partitions) as OUT/model.safetensors, with the model's "
                                                 "config and tokenizer: a folder from_pretrained loads.")
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="a checkpoint folder (RUN_DIR/checkpoints/...)")
    parser.add_argument("out", type=Path, metavar="OUT", help="the folder to write (new, or empty)")
    parser.add_argument("--accept-unverified", action="store_true",
                        help="read a checkpoint whose files do not match their SHA256SUMS digests (or have none)")
    args = parser.parse_args(argv)
    done = consolidate(args.checkpoint, args.out, args.accept_unverified)
    print(f"consolidated {done['parameters']:,} parameters ({done['tensors']} tensors) of the {done['engine']} checkpoint "
          f"at step {done['step']} into {args.out}: {', '.join(done['files'])}")
