"""QLoRA runs (--load-in-4bit) of the tiny Llama of lm_probe: its base saved with save_pretrained (another seed than
the factory's: the weights come from the folder), documents of random tokens, padded by lm_probe.pad.

    acc-trainer --model qlora_probe:llama --dataset qlora_probe:data --collate lm_probe:pad --init-from BASE ...
    acc-trainer launch --multi_gpu --num_processes 2 -m acc_trainer ...        (the same, on 2 processes)
"""

from __future__ import annotations

from pathlib import Path

from lm_probe import base_model, documents


def llama():
    """The architecture: with --load-in-4bit, built on the meta device, its class and config load the base."""
    return base_model()


def data():
    return documents(48, 0), documents(16, 1)


def preference_pairs():
    """Preference pairs of random words (dpo_probe's), for --objective dpo with --tokenizer lm_probe:chat_tokenizer."""
    from dpo_probe import pairs

    return pairs(21, 0), pairs(5, 1)


def write_base(folder: Path) -> Path:
    """The "pretrained" base: a from_pretrained folder of other weights than the factory's."""
    base_model(seed=1).save_pretrained(str(folder))
    return folder
