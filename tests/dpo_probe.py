"""DPO runs through acc_trainer.fit (--objective dpo), several in one launch of 1 or 2 processes: the tiny Llama of
lm_probe on preference pairs of random words (text pairs, or chat pairs through the chat template), with the word-level
tokenizer built there.

    python tests/dpo_probe.py OUT_DIR [JOB ...]                                       (1 process)
    acc-trainer launch --multi_gpu --num_processes 2 tests/dpo_probe.py OUT_DIR       (2 processes)
    dpo_probe.run_jobs(OUT_DIR, [JOB ...])                                            (the test's own process)

Each job's run folder is OUT_DIR/<job>. 21 training pairs in global batches of 8 (two steps an epoch: the last 5 are
left out, as every run's partial last batch); 5 evaluation pairs in batches of 4, split unevenly over 2 processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from lm_probe import TEMPLATE_PLAIN, WORDS, base_model, chat_tokenizer, end_launched, fresh_accelerate


def pairs(n: int, seed: int, chat: bool = False) -> list[dict]:
    """Preference pairs of 1 to 5 random words each (chat: one user turn, then the assistant's)."""
    g = torch.Generator().manual_seed(seed)

    def words() -> str:
        picks = torch.randint(0, len(WORDS), (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        return " ".join(WORDS[i] for i in picks)

    out = []
    for _ in range(n):
        prompt, chosen, rejected = words(), words(), words()
        if chat:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return out


COMMON = dict(objective="dpo", batch_size=8, eval_batch_size=4, max_steps=6, optimizer="sgd", lr=2.0, eval_every=3,
              log_every=1, progress="none", plots=False)
JOBS = {
    "full": dict(checkpoint_every=3),  # a frozen copy of the starting weights as the reference
    "accumulated": dict(micro_batch="2"),  # the same, 2 pairs a pass
    "lora": dict(lora=4, chat=False),  # the reference: the model with its adapters off
    # As "lora", the model without transformers' _no_split_modules: under FSDP2 (fsdp.yaml) not cut by layers (the
    # root and Accelerate's embeddings unit), whose parameters FSDP2 leaves gathered after a forward pass without
    # gradients. On 1 process it is "lora".
    "lora_whole": dict(lora=4, chat=False, whole=True),
    # As "full", with the model built from another seed on each process (a fit() model built without seeding): every
    # process starts from process 0's weights, and so must its reference. On 1 process it is "full".
    "unequal": dict(seed_by_rank=True),
}


def data(job: str) -> tuple[list, list]:
    chat = JOBS[job].get("chat", True)
    return pairs(21, 0, chat), pairs(5, 1, chat)


def run_jobs(out: Path, names=None) -> None:
    for name in names or JOBS:
        run_job(out / name, name)


def run_job(folder: Path, name: str) -> None:
    """The job NAME's run, into FOLDER (tests/engine_probe.py runs them under FSDP2 too)."""
    import acc_trainer

    options = {k: v for k, v in JOBS[name].items() if k not in ("chat", "seed_by_rank", "whole")}
    model = base_model(int(os.environ.get("RANK", "0")) if JOBS[name].get("seed_by_rank") else 0)
    if JOBS[name].get("whole"):
        model._no_split_modules = []
    acc_trainer.fit(model, *data(name), tokenizer=chat_tokenizer(TEMPLATE_PLAIN), output_dir=str(folder),
                    **{**COMMON, **options})
    fresh_accelerate()


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]), sys.argv[2:] or None)
    end_launched()
