"""Instruction and preference pairs from Python's own standard library, for supervised fine-tuning and DPO offline.

Every function of the library that has a docstring gives one pair: the prompt is the function's code with its
docstring taken out (its signature and the first lines of its body, then a line asking for the docstring), the
completion is the first paragraph of its docstring. The preference pairs have the same prompts; chosen is the
function's own docstring, rejected the docstring of a function of the library's test suites (drawn by a hash, the
same on every machine), which the model never sees as an answer. Files go to train or eval as in stdlib_lm.py (a
hash of their path). Three runs, from examples/ (docs/language-models.md#instruction-and-preference-data-on-the-standard-library):

    acc-trainer --config stdlib_lm.yaml            # the base model: the library's code, from random weights
    acc-trainer --config stdlib_sft.yaml           # supervised fine-tuning on the pairs: the loss on docstrings only
    acc-trainer --config stdlib_dpo.yaml           # DPO on the preference pairs, from the fine-tuned weights

`python stdlib_instruct.py OUT` writes the same pairs as JSONL files (sft-train.jsonl, sft-eval.jsonl,
dpo-train.jsonl, dpo-eval.jsonl) for `--dataset FILE`.
"""

from __future__ import annotations

import ast
import json
import sys
import textwrap
import zlib
from pathlib import Path

from stdlib_lm import TESTS, sources, split

ASK = "# Write the docstring of this function.\n"


def _docstring_pairs(files: list[Path], max_code_lines: int, max_doc_chars: int) -> list[dict]:
    pairs = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a few library files are written for other Python versions (lib2to3 data)
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(node.body) < 2:  # no docstring, or nothing but one
                continue
            summary = doc.strip().split("\n\n")[0].strip()
            if not 20 <= len(summary) <= max_doc_chars:
                continue
            head = lines[node.lineno - 1 - len(node.decorator_list):node.body[0].lineno - 1]  # decorators, def ...:
            body = lines[node.body[1].lineno - 1:(node.end_lineno or node.lineno)][:max_code_lines]
            code = textwrap.dedent("\n".join(head + body))  # a method's code as a function's
            pairs.append({"prompt": f"{code}\n{ASK}", "completion": f'"""{summary}"""\n',
                          "name": f"{path.stem}.{node.name}"})
    return pairs


def instructions(max_files: int | None = 200, max_eval_files: int | None = 20, max_code_lines: int = 12,
                 max_doc_chars: int = 200, eval_percent: int = 5):
    """`--dataset stdlib_instruct:instructions`: (train, eval) lists of {"prompt", "completion"}."""
    train, held_out = split(sources(exclude=TESTS), eval_percent)
    strip = lambda pairs: [{"prompt": p["prompt"], "completion": p["completion"]} for p in pairs]  # noqa: E731
    return (strip(_docstring_pairs(train[:max_files], max_code_lines, max_doc_chars)),
            strip(_docstring_pairs(held_out[:max_eval_files], max_code_lines, max_doc_chars)))


def conversations(max_files: int | None = 200, max_eval_files: int | None = 20, max_code_lines: int = 12,
                  max_doc_chars: int = 200, eval_percent: int = 5):
    """`--dataset stdlib_instruct:conversations`: the same pairs as chat messages, {"messages": [user, assistant]}
    (the code as the user's turn, the docstring as the assistant's), for a tokenizer with a chat template."""
    def chat(pair: dict) -> dict:
        return {"messages": [{"role": "user", "content": pair["prompt"].removesuffix(ASK)},
                             {"role": "assistant", "content": pair["completion"]}]}

    train, held_out = instructions(max_files, max_eval_files, max_code_lines, max_doc_chars, eval_percent)
    return [chat(p) for p in train], [chat(p) for p in held_out]


# A plain-text chat template for the example's tokenizer (which has no special tokens but its end-of-text): each
# turn opens with its role on a line of its own; the assistant's turn, in a generation block, ends with the
# end-of-text token, which then stops generation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}")


def chat_tokenizer():
    """`--tokenizer stdlib_instruct:chat_tokenizer`: stdlib_lm's byte-level BPE tokenizer with CHAT_TEMPLATE (a run
    keeps it, template included, in its own folder, where `AutoTokenizer.from_pretrained` loads it)."""
    from stdlib_lm import tokenizer

    tok = tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _rejected(pairs: list[dict], others: list[dict]) -> list[dict]:
    """Each pair's prompt with its own docstring (chosen) and a docstring of the library's test suites (rejected,
    drawn by a hash of the function's name): what a model that had read only tests would write."""
    out = []
    for p in pairs:
        other = others[zlib.crc32(p["name"].encode()) % len(others)]["completion"]
        if other != p["completion"]:
            out.append({"prompt": p["prompt"], "chosen": p["completion"], "rejected": other})
    return out


def preferences(max_files: int | None = 200, max_eval_files: int | None = 20, max_code_lines: int = 12,
                max_doc_chars: int = 200, eval_percent: int = 5, chat: bool = False):
    """`--dataset stdlib_instruct:preferences`: (train, eval) lists of {"prompt", "chosen", "rejected"}: text, or
    with `chat` messages as stdlib_instruct:conversations has them (prompt: [user], chosen and rejected: [assistant])."""
    train, held_out = split(sources(exclude=TESTS), eval_percent)
    tests = _docstring_pairs(sources(packages=["test"])[:200], max_code_lines, max_doc_chars)
    sets = [_rejected(_docstring_pairs(files, max_code_lines, max_doc_chars), tests)
            for files in (train[:max_files], held_out[:max_eval_files])]
    if chat:
        turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
        sets = [[{"prompt": turn("user", p["prompt"].removesuffix(ASK)), "chosen": turn("assistant", p["chosen"]),
                  "rejected": turn("assistant", p["rejected"])} for p in pairs] for pairs in sets]
    return tuple(sets)


def prefers(run_dir: str, pairs: list[dict], max_length: int = 256, batch_size: int = 32) -> float:
    """The fraction of `pairs` whose chosen completion the model of `run_dir` finds likelier than the rejected one
    (the sum of the completion's token log-probabilities), the folder loaded as transformers loads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acc_trainer.data.text import pad_id, preference_collate, tokenize_pair
    from acc_trainer.language.preference import sequence_logps

    tok, model = AutoTokenizer.from_pretrained(run_dir), AutoModelForCausalLM.from_pretrained(run_dir).eval()
    collate, wins = preference_collate(pad_id(tok), max_length), 0
    tokenized = [tokenize_pair(tok, p, max_length) for p in pairs]
    with torch.no_grad():
        for i in range(0, len(tokenized), batch_size):
            chosen, rejected = sequence_logps(model, collate(tokenized[i:i + batch_size])).chunk(2)
            wins += int((chosen > rejected).sum())
    return wins / len(tokenized)


if __name__ == "__main__" and sys.argv[1:2] == ["--prefers"]:  # python stdlib_instruct.py --prefers RUN_DIR ...
    held_out = preferences(chat=True)[1]
    for run_dir in sys.argv[2:]:
        print(f"{run_dir}: prefers the chosen docstring in {prefers(run_dir, held_out):.1%} of {len(held_out)} "
              "held-out pairs")
elif __name__ == "__main__":  # python stdlib_instruct.py OUT: the pairs as JSONL files
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/stdlib-pairs")
    out.mkdir(parents=True, exist_ok=True)
    for name, (train, held_out) in (("sft", instructions()), ("dpo", preferences())):
        for split_name, rows in (("train", train), ("eval", held_out)):
            with open(out / f"{name}-{split_name}.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            print(f"{out / f'{name}-{split_name}.jsonl'}: {len(rows)} pairs")
