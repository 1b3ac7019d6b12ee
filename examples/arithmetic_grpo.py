"""GRPO with a verifiable reward, on data every machine has: sums of two digits (docs/language-models.md#an-example-
that-learns-sums).

A small Llama-style model is first fine-tuned (supervised) on sums whose answers are wrong more often than right: for
each of the 100 sums a+b, 3 samples answer a+b+1 and 2 answer a+b. It learns the mistake: greedy decoding answers
a+b+1. GRPO then trains it with a reward that checks the answer (1 for the right sum, else 0) on 80 of the sums; the
20 others are held out, and their reward (greedy, the share answered right) is measured before and after.

    python arithmetic_grpo.py [OUT_DIR] [--sft-steps N] [--grpo-steps N]

Nothing is downloaded: the tokenizer (a token per digit, `+`, `=`) and the model are built here.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

HELD_OUT = 20


def tokenizer():
    """A token per digit and sign, [PAD] and [EOS]; no chat template (the prompts are text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[EOS]", "[UNK]", *"0123456789", "+", "="])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Fuse()  # "1", "2" decode as "12"
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(config)


def sums() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(the 80 sums GRPO trains on, the 20 held out), split by a fixed shuffle."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    return pairs[HELD_OUT:], pairs[:HELD_OUT]


def noisy_answers() -> list[dict]:
    """Every sum 5 times: 3 answered one too high, 2 right (prompt/completion text; the EOS is appended)."""
    return [{"prompt": f"{a}+{b}=", "completion": str(a + b + wrong)}
            for a in range(10) for b in range(10) for wrong in (1, 1, 1, 0, 0)]


def prompts(pairs) -> list[dict]:
    """Prompts with the right answer as a column, which the reward function is given."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def prompt_sets() -> tuple[list[dict], list[dict]]:
    """(the 80 training prompts, the 20 held out) as a dataset factory: `--dataset arithmetic_grpo:prompt_sets`
    (examples/arithmetic_grpo_bench.yaml)."""
    train, held_out = sums()
    return prompts(train), prompts(held_out)


def right_answer(prompts, completions, answer, **columns) -> list[float]:
    """The verifiable reward: 1 when the completion is the sum, else 0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def greedy_share(trained, tok, pairs) -> float:
    """The share of `pairs` whose greedy answer is right (transformers' own generate)."""
    right = 0
    for row in prompts(pairs):
        ids = tok(row["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = trained.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                   pad_token_id=0, eos_token_id=1)
        right += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == row["answer"]
    return right / len(pairs)


def main(argv=None) -> dict:
    import acc_trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="runs/arithmetic")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=40)
    args = parser.parse_args(argv)
    out, tok = Path(args.out), tokenizer()
    train, held_out = sums()
    sft = model()
    acc_trainer.fit(sft, noisy_answers(), tokenizer=tok, output_dir=str(out / "sft"), batch_size=50,
                    max_steps=args.sft_steps, optimizer="adamw", lr=3e-3, plots=False, progress="plain", log_every=50)
    from transformers import AutoModelForCausalLM

    before = greedy_share(AutoModelForCausalLM.from_pretrained(out / "sft"), tok, held_out)
    summary = acc_trainer.fit(model(), prompts(train), prompts(held_out), tokenizer=tok, objective="grpo",
                              rewards=[right_answer], init_from=str(out / "sft"), output_dir=str(out / "grpo"),
                              batch_size=64, num_generations=8, max_completion_length=3, max_steps=args.grpo_steps,
                              optimizer="adamw", lr=1e-3, log_every=10, eval_every=args.grpo_steps, plots=False,
                              progress="plain", log_completions=10)
    after = greedy_share(AutoModelForCausalLM.from_pretrained(out / "grpo"), tok, held_out)
    figures = {"held_out_right_before": before, "held_out_right_after": after,
               "grpo_eval_reward": summary["eval"]["reward"]}
    print(json.dumps(figures))
    (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
