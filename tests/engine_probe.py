"""Language-model runs under an engine (DDP, FSDP2) through acc_trainer.fit, several in one launch: a small Llama
with tied embeddings (tests/lm_probe.py's) trained in full, with LoRA and with frozen layers, and runs that continue
another run's checkpoint (written under another engine or number of processes).

    python tests/engine_probe.py OUT NAME=JOB[@CHECKPOINT] ...                          (1 process)
    acc-trainer launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 \\
        tests/engine_probe.py OUT NAME=JOB[@CHECKPOINT] ...                              (FSDP2, 2 processes)

Each run's folder is OUT/NAME; `@CHECKPOINT` resumes from that checkpoint folder. JOB `dpo:DPO_JOB` is
tests/dpo_probe.py's DPO job of that name (preference pairs, --objective dpo), in the same launch (no @CHECKPOINT);
JOB `wrap:WRAP` the full job under one of WRAPS' auto-wrap policies (FSDP2); JOB `refused:JOB` resumes from a
checkpoint a test has changed (its digests then removed) with --accept-unverified, and is to stop in one line, which
goes into OUT/NAME/refused.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lm_probe import VOCAB, base_model, documents, pad

# SGD with momentum: the optimizer has a state to carry over, and the run is not chaotic (Adam's first steps turn a
# gradient's rounding into a whole step's sign). A global batch of 12: 12, 6 or 4 samples a process on 1, 2 or 3.
COMMON = dict(collate_fn=pad, batch_size=12, max_steps=6, optimizer="sgd", lr=0.1, momentum=0.9, eval_every=3,
              checkpoint_every="3", progress="none", plots=False)
JOBS = {
    "full": dict(),
    "lora": dict(lora=4, lora_merge=True, prompts=["w1 w2 w3"], max_new_tokens=4),
    "freeze": dict(freeze=r"embed_tokens|layers\.0\."),
    # The same layers frozen in the first epoch only (3 steps an epoch), trained from the second.
    "unfreeze": dict(freeze=r"embed_tokens|layers\.0\.", unfreeze_at=2, batch_size=24),
}
# The full job under auto-wrap policies of a user's own accelerate config (FSDP2): all but the last are refused in one
# line before `prepare` (OUT/NAME/refused.txt holds the line), where Accelerate would fail with torch's traceback (in
# `prepare`, or at the first forward pass for "tied"). The model's decoder layers hold 9,280 parameters each,
# `model.layers` 18,560, `model` (with the embedding) 20,640; "whole" cuts no block out (Accelerate's unit of the
# tied embedding and head with the final norm apart) and trains.
WRAPS = {
    "list": {"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1000"},
    "embedding": {"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "19000"},
    "tied": {"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Embedding"},
    "class": {"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block"},
    "whole": {"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1000000"},
}


def tokenizer():
    """A word-level tokenizer over the model's vocabulary ("w1" ... "w63"; 0 is unknown and padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[UNK]")


def run(out: Path, specs: list[str]) -> None:
    from accelerate.state import AcceleratorState, GradientState

    import acc_trainer

    for spec in specs:
        name, job = spec.split("=", 1)
        if job.startswith("dpo:"):
            import dpo_probe

            dpo_probe.run_job(out / name, job.removeprefix("dpo:"))
            continue
        if job.startswith("wrap:"):
            _under_policy(out / name, WRAPS[job.removeprefix("wrap:")])
            continue
        job, _, resume = job.partition("@")
        if job.startswith("refused:"):
            _refused(out / name, {**COMMON, **JOBS[job.removeprefix("refused:")], "resume": resume,
                                  "accept_unverified": True})
            continue
        options = {**COMMON, **JOBS[job]}
        if "prompts" in options:
            options["tokenizer"] = tokenizer()
        acc_trainer.fit(base_model(), documents(72, 0), documents(16, 1), output_dir=str(out / name),
                        **options, **({"resume": resume} if resume else {}))
        GradientState._reset_state()  # the next fit's Accelerator starts from a fresh state, on the same processes
        AcceleratorState._reset_state()


def _under_policy(folder: Path, config: dict) -> None:
    """The full job with CONFIG's FSDP_ variables (what accelerate launch sets from a config's fsdp_config), in FOLDER;
    the error it stops with in FOLDER/refused.txt."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, config):  # the launch's own values back afterwards
        _refused(folder, COMMON)


def _refused(folder: Path, options: dict) -> None:
    """The run of OPTIONS in FOLDER; the error it stops with in FOLDER/refused.txt."""
    from accelerate.state import AcceleratorState, GradientState

    import acc_trainer
    from acc_trainer.config import ConfigError

    try:
        acc_trainer.fit(base_model(), documents(72, 0), documents(16, 1), output_dir=str(folder), **options)
    except ConfigError as e:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "refused.txt").write_text(str(e))
    finally:
        GradientState._reset_state()
        AcceleratorState._reset_state()


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
    from accelerate import PartialState

    from acc_trainer.patches import leave_without_teardown

    # As the command line ends a finished process: torch 2.14's gloo may abort one in the interpreter's teardown.
    PartialState().destroy_process_group()
    leave_without_teardown(0)
