"""Generated text and the tokenizer (issue 32, points 1 and 5): samples from the user's prompts at each evaluation
(the log, samples.jsonl, TensorBoard) that leave the trained weights as they are, the tokenizer saved where the
weights are, `predict` on a language model (per-sequence loss and perplexity, or generated text), and the one-line
errors. A 2-layer Llama from its config and a word-level tokenizer trained here: nothing is downloaded."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import check, run_here, summary
from safetensors.torch import load_file

PROJECT = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TOKENIZER = PreTrainedTokenizerFast(tokenizer_file="tokenizer.json", unk_token="[UNK]", pad_token="[PAD]",
                                    eos_token="[EOS]")
LINES = open("corpus.txt").read().splitlines()


def model():
    # attention dropout on: training draws random numbers, which a generation drawing any would shift
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        attention_dropout=0.1, pad_token_id=1, eos_token_id=2, bos_token_id=None))


def row(line, length=8):
    ids = TOKENIZER(line)["input_ids"][:length]
    real = len(ids)
    ids = torch.tensor(ids + [1] * (length - real))
    mask = (torch.arange(length) < real).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def data():
    rows = [row(line) for line in LINES]
    return rows[:24], rows[24:]
'''
WORDS = ("the cat sat on the mat", "a dog ate the bone", "the bird flew over the old house",
         "a cat saw the dog", "the dog ran", "an old bird sang on the house")
PROMPTS = ["the cat", "a dog ate"]
JOB = ["--model", "lm:model", "--dataset", "lm:data", "--batch-size", "8", "--max-steps", "6", "--eval-every", "2",
       "--checkpoint-every", "3", "--optimizer", "adamw", "--lr", "0.01", "--progress", "plain", "--no-plots"]
WITH = ["--tokenizer", "tok", "--prompts", "prompts.txt", "--max-new-tokens", "5", "--log-with", "tensorboard"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The user's folder (lm.py, its corpus, a tokenizer saved with save_pretrained, prompts.txt) and two runs of
    the same job: `with` prompts (and the tokenizer, and TensorBoard), `without` them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("lm")
    (folder / "corpus.txt").write_text("\n".join(WORDS * 6) + "\n")
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(WORDS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"]))
    words.save(str(folder / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="[EOS]").save_pretrained(folder / "tok")
    (folder / "lm.py").write_text(PROJECT)
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    runs = {"with": check(run_here(*JOB, *WITH, "--output-dir", "with", cwd=folder)),
            "without": check(run_here(*JOB, "--output-dir", "without", cwd=folder))}
    yield SimpleNamespace(folder=folder, printed={name: result.stdout for name, result in runs.items()})
    sys.modules.pop("lm", None)


def _samples(run) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def test_samples_at_each_evaluation_leave_the_weights_bit_identical(project):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = project.folder / "with"
    # Generating (greedy, random generators kept) changed nothing of training, dropout's draws included.
    weights, reference = load_file(run / "model.safetensors"), load_file(project.folder / "without" / "model.safetensors")
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    samples = _samples(run)
    assert [(s["step"], s["prompt"]) for s in samples] == [(step, p) for step in (2, 4, 6) for p in PROMPTS]
    for s in samples:  # in the log as well
        assert f"sample at step {s['step']}: {s['prompt']!r} -> {s['text']!r}\n" in project.printed["with"]
    assert "sample at" not in project.printed["without"]
    # The last samples are the final model's greedy continuations, as transformers' generate writes them.
    model, tokenizer = AutoModelForCausalLM.from_pretrained(run).eval(), AutoTokenizer.from_pretrained(run)
    for s in samples[-2:]:
        ids = tokenizer(s["prompt"], return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert s["text"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) and s["text"]
    # TensorBoard holds the same texts, at the same steps.
    events = EventAccumulator(str(run / "logs" / "acc_trainer"), size_guidance={"tensors": 0})
    events.Reload()
    logged = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("samples/1/text_summary")]
    assert logged == [(s["step"], s["prompt"] + s["text"]) for s in samples if s["prompt"] == PROMPTS[1]]


def test_the_tokenizer_is_saved_with_the_run_and_each_checkpoint(project):
    from transformers import AutoTokenizer

    from acc_trainer.outputs.checkpoints import damage

    run, text = project.folder / "with", "the old cat flew over a zebra"
    given = AutoTokenizer.from_pretrained(project.folder / "tok")
    for folder in (run, run / "checkpoints" / "step-00000003", run / "checkpoints" / "step-00000006"):
        loaded = AutoTokenizer.from_pretrained(folder)
        assert loaded(text)["input_ids"] == given(text)["input_ids"], folder
        assert "tokenizer.json" in (folder / "SHA256SUMS").read_text() and damage(folder, ["tokenizer.json"]) is None
    assert not (project.folder / "without" / "tokenizer.json").exists()  # none given, none saved


def test_a_resumed_run_writes_each_evaluations_samples_once(project):
    """Resumed from step 3: the samples of steps 4 and 6 are written again, in place of the first attempt's."""
    again = project.folder / "again"
    shutil.copytree(project.folder / "with", again)
    shutil.rmtree(again / "checkpoints" / "step-00000006")
    (again / "summary.json").unlink()  # stopped after step 3, not finished (a finished run is not continued)
    check(run_here(*JOB, *WITH, "--output-dir", "again", "--resume", "auto", cwd=project.folder))
    assert _samples(again) == _samples(project.folder / "with")


def test_predict_on_a_language_model_writes_each_sequences_loss_or_generated_text(project):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(project.folder))
    lm = __import__("lm")
    rows = lm.data()[1]
    model = AutoModelForCausalLM.from_pretrained(project.folder / "with").eval()
    check(run_here("predict", "with", "--output", "rows.npz", cwd=project.folder))
    with np.load(project.folder / "rows.npz") as arrays:
        assert sorted(arrays) == ["index", "loss", "perplexity", "tokens"]
        assert arrays["index"].tolist() == list(range(len(rows)))
        i = 2
        with torch.no_grad():  # transformers' own loss of that sequence alone: the mean over its next tokens
            by_hand = model(**{k: v[None] for k, v in rows[i].items()}).loss.item()
        assert arrays["loss"][i] == pytest.approx(by_hand, rel=1e-5)
        assert np.allclose(arrays["perplexity"], np.exp(arrays["loss"]), rtol=1e-6)
        assert arrays["tokens"].tolist() == [int(r["attention_mask"].sum()) - 1 for r in rows]
        # weighted by their tokens, the rows give the run's own evaluation loss of these weights (step 6)
        token_mean = (arrays["loss"] * arrays["tokens"]).sum() / arrays["tokens"].sum()
        assert token_mean == pytest.approx(summary(project.folder / "with")["eval"]["loss"], rel=1e-5)
    check(run_here("predict", "with", "--generate", "--max-new-tokens", "4", "--output", "text.csv", cwd=project.folder))
    with open(project.folder / "text.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["index", "prompt", "text"] and len(table) == len(rows)
    for line, row, written in zip(lm.LINES[24:], rows, table):  # each input without its padding, as given
        ids = row["input_ids"][row["attention_mask"].bool()][None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=1)
        assert written["prompt"] == line and written["text"] == lm.TOKENIZER.decode(out[0, ids.shape[1]:])


def test_fit_takes_a_tokenizer_object(project, tmp_path):
    """fit(tokenizer=...) with prompts: the samples, and the tokenizer saved with the weights."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoTokenizer

    import acc_trainer

    sys.path.insert(0, str(project.folder))
    lm = __import__("lm")
    train, held_out = lm.data()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        acc_trainer.fit(lm.model(), train, held_out, tokenizer=lm.TOKENIZER, prompts=["the dog"], max_new_tokens=3,
                        batch_size=8, max_steps=2, progress="none", plots=False, output_dir=str(tmp_path / "fit"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert [(s["step"], s["prompt"]) for s in _samples(tmp_path / "fit")] == [(2, "the dog")]
    assert AutoTokenizer.from_pretrained(tmp_path / "fit")("the dog")["input_ids"] == lm.TOKENIZER("the dog")["input_ids"]


@pytest.mark.parametrize("args, message", [
    (["--model", "lenet", "--dataset", "fake", "--tokenizer", "tok", "--prompts", '["the cat"]'],
     "acc-trainer: error: --prompts: LeNet cannot generate text (it has no generate(), or its can_generate() is False); "
     "a transformers model with a language-model head (...ForCausalLM) can\n"),
    (["--model", "lm:model", "--dataset", "lm:data", "--batch-size", "8", "--prompts", "prompts.txt"],
     "acc-trainer: error: --prompts needs a tokenizer, to turn the text into tokens and back: give --tokenizer (or "
     "fit(tokenizer=...))\n"),
    (["--model", "lm:model", "--dataset", "lm:data", "--batch-size", "8", "--tokenizer", "no-such-folder"],
     "acc-trainer: error: --tokenizer no-such-folder: no such folder or file (give a folder saved with save_pretrained, "
     "a tokenizer.json, or an import path pkg.module:factory)\n"),
    (["--model", "lm:model", "--dataset", "lm:data", "--batch-size", "8", "--tokenizer", "with/logs"],
     "acc-trainer: error: --tokenizer with/logs: the folder holds no tokenizer (no tokenizer_config.json or "
     "tokenizer.json, which save_pretrained writes)\n"),
    (["--model", "lm:model", "--dataset", "lm:data", "--batch-size", "8", "--tokenizer", "prompts.txt"],
     "acc-trainer: error: --tokenizer prompts.txt does not load as a tokenizer: Exception: "),
    (["--model", "lm:model", "--dataset", "lm:data", "--batch-size", "8", "--tokenizer", "tok", "--prompts", "missing.txt"],
     "acc-trainer: error: --prompts missing.txt: cannot be read (No such file or directory); give a text file with one "
     "item per line, or a YAML list '[\"...\", \"...\"]'\n"),
    (["predict", "without", "--generate", "--output", "never.jsonl"],
     "acc-trainer: error: predict --generate needs a tokenizer, to turn the text into tokens and back: give --tokenizer "
     "(the run folder holds none)\n"),
])
def test_bad_input_is_one_line(project, args, message):
    result = run_here(*args, "--output-dir", "never", cwd=project.folder) if args[0] != "predict" else \
        run_here(*args, cwd=project.folder)
    assert result.returncode == 2 and result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert not (project.folder / "never").exists() and not (project.folder / "never.jsonl").exists()


def test_predict_generates_from_prompts_without_labels_in_python(project, monkeypatch):
    """`predict(RUN, model=..., data=prompts, generate=True)`: inputs to continue need no labels; the first-sample
    check, which asked for a loss, is the training path's, not generation's."""
    from accelerate.state import AcceleratorState, GradientState

    import acc_trainer

    monkeypatch.chdir(project.folder)
    monkeypatch.syspath_prepend(str(project.folder))
    lm = __import__("lm")
    prompts = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]} for r in lm.data()[1][:3]]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    rows = acc_trainer.predict(project.folder / "with", model=lm.model(), data=prompts, generate=True, max_new_tokens=3,
                               progress="none")
    assert [r["index"] for r in rows] == [0, 1, 2] and all(set(r) == {"index", "prompt", "text"} for r in rows), rows


def test_predict_continues_each_conversation_before_its_last_answer(tmp_path):
    """predict(generate=True) on chat data: each conversation continued before its last assistant turn, which is kept
    as `reference` and never given to the model; the batch, generated together (left-padded), gives each conversation
    the text it gets alone."""
    from accelerate.state import AcceleratorState, GradientState
    from lm_probe import TEMPLATE_PLAIN, base_model, chat_tokenizer, conversations

    import acc_trainer

    tokenizer, model, chats = chat_tokenizer(TEMPLATE_PLAIN), base_model(seed=3).eval(), conversations(6, 0)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    rows = acc_trainer.predict(model, data=chats, generate=True, tokenizer=tokenizer, max_new_tokens=4, batch_size=3,
                               progress="none")
    assert [r["index"] for r in rows] == list(range(6))
    for chat, row in zip(chats, rows, strict=True):
        prompt = tokenizer.apply_chat_template(chat["messages"][:-1], add_generation_prompt=True, return_dict=True)
        ids = torch.tensor([list(prompt["input_ids"])])
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)
        assert row["prompt"] == tokenizer.decode(ids[0], skip_special_tokens=True)
        assert row["text"] == tokenizer.decode(alone[0, ids.shape[1]:], skip_special_tokens=True)
        assert row["reference"] == chat["messages"][-1]["content"]
