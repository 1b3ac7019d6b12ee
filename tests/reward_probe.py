"""Reward-model runs through acc_trainer.fit (--objective reward), in one launch of 1 or 2 processes: a tiny
LlamaForSequenceClassification (one output) built from lm_probe's config, on preference pairs of random words whose
chosen completion holds the word "good" and whose rejected one never does (learnable), with lm_probe's word-level
tokenizer.

    python tests/reward_probe.py OUT_DIR [JOB ...]                                    (1 process)
    acc-trainer launch --multi_gpu --num_processes 2 tests/reward_probe.py OUT_DIR    (2 processes)
    reward_probe.run_jobs(OUT_DIR, [JOB ...])                                         (the test's own process)

Each job's run folder is OUT_DIR/<job>. 40 training pairs in global batches of 8; 9 evaluation pairs in batches of 4,
split unevenly over 2 processes. The 2-process launch runs text, chat and tokenized ("accumulated" is "tokenized" on one
process, 2 pairs a pass).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lm_probe import TEMPLATE_PLAIN, WORDS, base_model, chat_tokenizer, end_launched, fresh_accelerate

PLAIN = [w for w in WORDS if w != "good"]


def reward_model(seed: int = 0, num_labels: int = 1):
    """lm_probe's Llama as a sequence classifier with `num_labels` outputs (its pad_token_id left for the run to set)."""
    from transformers import LlamaForSequenceClassification

    config = base_model().config
    config.num_labels = num_labels
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config)


def pairs(n: int, seed: int, chat: bool = False, margin: bool = False) -> list[dict]:
    """Pairs of 1 to 4 random words each, "good" put among the chosen completion's words (chat: one user turn, then
    the assistant's); `margin`: a margin column too."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int | None = None) -> list[str]:
        k = k or int(torch.randint(1, 5, (1,), generator=g))
        return [PLAIN[i] for i in torch.randint(0, len(PLAIN), (k,), generator=g)]

    out = []
    for _ in range(n):
        chosen = words()
        chosen.insert(int(torch.randint(0, len(chosen) + 1, (1,), generator=g)), "good")
        prompt, chosen, rejected = " ".join(words()), " ".join(chosen), " ".join(words())
        if chat:
            pair = {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]}
        else:
            pair = {"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected}
        if margin:
            pair["margin"] = float(torch.rand(1, generator=g))
        out.append(pair)
    return out


COMMON = dict(objective="reward", batch_size=8, eval_batch_size=4, max_steps=10, optimizer="adam", lr=1e-3,
              eval_every=5, log_every=1, progress="none", plots=False)
JOBS = {
    "text": dict(),
    "chat": dict(chat=True, center_rewards_coefficient=0.01),
    # Pairs tokenized beforehand (prompt_ids, chosen_ids, rejected_ids) with a margin column, trained with SGD (whose
    # steps, unlike Adam's, scale with the gradient: a loss normalised otherwise than over the global batch shows).
    "tokenized": dict(tokenized=True, optimizer="sgd", lr=0.02),
    "accumulated": dict(tokenized=True, optimizer="sgd", lr=0.02, micro_batch="2"),  # the same, 2 pairs a pass
}


def data(job: str = "text") -> tuple[list, list]:
    chat = JOBS[job].get("chat", False)
    if JOBS[job].get("tokenized"):
        return tokenized(pairs(40, 0, margin=True)), tokenized(pairs(9, 1, margin=True))
    return pairs(40, 0, chat), pairs(9, 1, chat)


def tokenized(rows: list[dict]) -> list[dict]:
    """The pairs as token ids (chat.tokenize_pair, with lm_probe's tokenizer), each with its margin."""
    from acc_trainer.data.text import tokenize_pair

    tokenizer = chat_tokenizer(TEMPLATE_PLAIN)
    return [{**tokenize_pair(tokenizer, row), "margin": row["margin"]} for row in rows]


def run_jobs(out: Path, names=None) -> dict:
    """Each job's run into OUT/<job>; the models fit() trained, by job."""
    import acc_trainer

    trained = {}
    for name in names or JOBS:
        options = {k: v for k, v in JOBS[name].items() if k not in ("chat", "tokenized")}
        trained[name] = reward_model()
        acc_trainer.fit(trained[name], *data(name), tokenizer=chat_tokenizer(TEMPLATE_PLAIN), output_dir=str(out / name),
                        **{**COMMON, **options})
        fresh_accelerate()
    return trained


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]), sys.argv[2:] or None)
    end_launched()
