"""GRPO runs through acc_trainer.fit (--objective grpo), several in one launch of 1, 2 or 3 processes: the tiny Llama
of lm_probe writes completions to prompts of random words, with the word-level tokenizer built there, scored by the
reward functions below (importable by every process).

    python tests/grpo_probe.py OUT_DIR [JOB ...]                                       (1 process)
    acc-trainer launch --multi_gpu --num_processes 2 tests/grpo_probe.py OUT_DIR       (2 or 3 processes)
    grpo_probe.run_jobs(OUT_DIR, [JOB ...])                                            (the test's own process)

Each job's run folder is OUT_DIR/<job>. 24 training prompts, 12 completions a step (6 prompts x 2 generations), 4
steps; 5 evaluation prompts (split unevenly over 2 and 3 processes), greedy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from lm_probe import WORDS, base_model, chat_tokenizer, end_launched, fresh_accelerate


def says_cat(prompts, completions, **columns) -> list[float]:
    """1 for each "cat" in the completion (a chat completion: its assistant message)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(text.split().count("cat")) for text in texts]


def brief(prompts, completions, completion_ids, **columns) -> list[float]:
    """Shorter is better: minus a tenth of the completion's tokens."""
    return [-len(ids) / 10 for ids in completion_ids]


def topic_said(prompts, completions, topic, **columns) -> list[float | None]:
    """The prompt's own column `topic` said in the completion (None: a prompt without a topic)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if t is None else float(t in text.split()) for t, text in zip(topic, texts, strict=True)]


CALLS = []  # flaky's calls in this process


def flaky(prompts, completions, **columns) -> list[float]:
    """1 for each completion; on process 1 only, from its second call on (step 2's rollout), it raises."""
    CALLS.append(len(completions))
    if os.environ.get("RANK") == "1" and len(CALLS) > 2:  # its first call: the first-sample check's
        raise ValueError("no reward on this process")
    return [1.0] * len(completions)


def prompts(n: int, seed: int, chat: bool = False) -> list[dict]:
    """Prompts of 1 to 4 random words, each with a `topic` column (a word of the prompt, or None for every fifth)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        picks = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (int(torch.randint(1, 5, (1,), generator=g)),),
                                                       generator=g)]
        text = " ".join(picks)
        out.append({"prompt": [{"role": "user", "content": text}] if chat else text,
                    "topic": None if i % 5 == 4 else picks[0]})
    return out


COMMON = dict(objective="grpo", batch_size=12, num_generations=2, max_completion_length=6, eval_batch_size=2,
              max_steps=4, optimizer="sgd", lr=0.5, eval_every=2, log_every=1, log_completions=1, checkpoint_every=2,
              progress="none", plots=False)
JOBS = {
    "base": dict(),  # dapo, scaled per group, no reference
    "accumulated": dict(grad_accum=2),  # the same, 3 prompts a pass
    # the other paths: the batch's deviation, bnpo, a frozen copy as the reference, two steps a generation (their
    # log-probabilities kept and clipped), filtered sampling, chat prompts
    "others": dict(scale_rewards="batch", loss_type="bnpo", grpo_beta=0.1, num_iterations=2, epsilon_high=0.28,
                   temperature=0.9, top_k=20, top_p=0.95, chat=True),
    "lora": dict(lora=4, grpo_beta=0.1, loss_type="grpo", lr=2.0),  # the reference: the model with its adapters off
    "packed": dict(generation_groups=3),  # 3 prompts' groups in one batch: 6 rows, prompts of unequal lengths
}
REWARDS = [says_cat, brief, topic_said]


def data(job: str) -> tuple[list, list]:
    chat = JOBS[job].get("chat", False)
    return prompts(24, 0, chat), prompts(5, 1, chat)


def run_jobs(out: Path, names=None) -> None:
    for name in names or JOBS:
        run_job(out / name, name)


def run_job(folder: Path, name: str, **more) -> None:
    import acc_trainer

    options = {k: v for k, v in JOBS[name].items() if k != "chat"}
    acc_trainer.fit(base_model(0), *data(name), tokenizer=chat_tokenizer(), rewards=REWARDS, output_dir=str(folder),
                    **{**COMMON, **options, **more})
    fresh_accelerate()


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]), sys.argv[2:] or None)
    end_launched()
