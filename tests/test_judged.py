"""A language model judged by what it writes (--judge, acc_trainer/objectives/judged.py): at each evaluation every
held-out conversation is continued before its last assistant turn and judged against that turn. The figures are
those of transformers' own greedy generate on the run's weights, every conversation counted once on 1 and 2
processes; the wrong input is one line."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import lm_probe  # noqa: E402
from conftest import REPO, check, forked_cli, metrics, run_here, summary  # noqa: E402


def overlap(prompts, completions, references, **columns) -> list[float]:
    """The share of the reference's words the text written holds (None for a one-word reference)."""
    out = []
    for text, reference in zip(completions, references, strict=True):
        words = reference.split()
        out.append(None if len(words) < 2 else sum(w in text.split() for w in words) / len(words))
    return out


def write(folder, rows) -> str:
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def by_hand(run, rows) -> dict:
    """The judged figures computed here: each conversation's prompt (the chat template's rendering up to its last
    assistant turn, with the generation prompt) continued by transformers' generate, greedy, on the run's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(run).eval(), AutoTokenizer.from_pretrained(run)
    exact, overlaps = [], []
    for row in rows:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids = tokenizer.apply_chat_template(messages[:last], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        reference = tokenizer.decode(tokenizer.apply_chat_template(messages[:last + 1], return_dict=True)["input_ids"]
                                     [ids.shape[1]:], skip_special_tokens=True)
        exact.append(float(text.strip() == reference.strip()))
        value = overlap(None, [text], [reference])[0]
        if value is not None:
            overlaps.append(value)
    return {"eval_judged/exact_match": sum(exact) / len(exact), "eval_judged/overlap": sum(overlaps) / len(overlaps)}


def test_judged_figures_are_transformers_greedy_answers_on_any_number_of_processes(tmp_path):
    # The assistant always answers "you are welcome" in training, and in 4 of the 7 held-out chats: learnt in a few
    # steps, the judged figures are neither 0 nor 1.
    train = [{"messages": [*chat["messages"][:-1], {"role": "assistant", "content": "you are welcome"}]}
             for chat in lm_probe.conversations(24, 0)]
    held_out = [{"messages": [*chat["messages"][:-1], {"role": "assistant", "content": "you are welcome"}]}
                if i % 2 == 0 else chat for i, chat in enumerate(lm_probe.conversations(7, 1))]
    lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN).save_pretrained(tmp_path / "tok")
    args = ["--model", "lm_probe:base_model", "--dataset", write(tmp_path, train), "--dataset-args",
            json.dumps({"eval": write(tmp_path / "tok", held_out)}), "--tokenizer", tmp_path / "tok", "--judge",
            "exact_match,test_judged:overlap", "--max-new-tokens", "6", "--batch-size", "8", "--eval-batch-size", "2",
            "--max-steps", "12", "--eval-every", "6", "--optimizer", "adamw", "--lr", "0.01", "--no-plots", "--progress", "none"]
    check(run_here(*args, "--output-dir", tmp_path / "p1", cwd=REPO / "tests"))
    forked_cli(*args, "--output-dir", tmp_path / "p2", cwd=REPO / "tests")
    finals = [next(row for row in reversed(metrics(tmp_path / f"p{n}")) if "eval_judged/overlap" in row) for n in (1, 2)]
    assert finals[0]["eval_samples"] == finals[1]["eval_samples"] == 7
    found = by_hand(tmp_path / "p1", held_out)
    assert 0 < found["eval_judged/exact_match"] < 1 and 0 < found["eval_judged/overlap"] < 1, found
    for final in finals:
        assert {k: final[k] for k in found} == pytest.approx(found, abs=1e-9)
    assert summary(tmp_path / "p2")["eval"]["judged/exact_match"] == found["eval_judged/exact_match"]
    assert [row["step"] for row in metrics(tmp_path / "p2") if "eval_judged/exact_match" in row] == [6, 12]


def test_the_wrong_input_is_one_line(tmp_path):
    from conftest import reset_accelerate

    import acc_trainer
    from acc_trainer.config import ConfigError

    chats, tokenizer = lm_probe.conversations(8, 0), lm_probe.chat_tokenizer()  # (no tokenizer: the chats' own line)
    options = dict(batch_size=4, max_steps=1, progress="none", plots=False, judge=["exact_match"])
    documents = lm_probe.documents(8, 0)
    cases = [(dict(data=(documents, documents[:4]), tokenizer=tokenizer), "it takes an evaluation set of chat or "
                                                                            "prompt/completion data"),
             (dict(data=(chats, chats[:4]), tokenizer=tokenizer, judge=["no_such_module:fn"]),
              "no module named 'no_such_module'"),
             (dict(data=(chats, chats[:4]), tokenizer=tokenizer, objective="dpo"), "--judge applies with --objective lm")]
    for i, (case, message) in enumerate(cases):
        data = case.pop("data")
        with pytest.raises(ConfigError, match=message):
            acc_trainer.fit(lm_probe.base_model(), *data, output_dir=str(tmp_path / str(i)), **{**options, **case})
        reset_accelerate()
        assert not (tmp_path / str(i)).exists()
