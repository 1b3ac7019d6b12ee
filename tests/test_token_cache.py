"""Text tokenized once (docs/language-models.md#the-token-cache): chat, prompt/completion, text, preference pairs and
GRPO's prompts give the same tokens tokenized in this process, by two forked processes, or read back from the token
cache; the cache's key changes with what changes tokens (the data, the tokenizer, its template, --max-length,
--train-on-prompt) and with nothing else; a run's `evaluate` and `--resume` read it; a file that cannot be read is
tokenized again; a bad sample in a tokenizing process is the serial run's one line, and stays that line."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

import lm_probe  # noqa: E402 - after the skip
from conftest import summary  # noqa: E402

from acc_trainer.config import ConfigError, TrainConfig  # noqa: E402
from acc_trainer.data import text as chat  # noqa: E402
from acc_trainer.data import token_cache  # noqa: E402


def chats(n: int, seed: int = 0) -> list[dict]:
    return lm_probe.conversations(n, seed)


def completions(n: int) -> list[dict]:
    return [{"prompt": c["messages"][-2]["content"], "completion": " " + c["messages"][-1]["content"]}
            for c in chats(n, 1)]


def texts(n: int) -> list[dict]:
    return [{"text": c["messages"][-1]["content"]} for c in chats(n, 2)]


def preferences(n: int) -> list[dict]:
    """Chat pairs, every other one with a reward model's margin."""
    rows = []
    for i, (a, b) in enumerate(zip(chats(n, 3), chats(n, 4))):
        rows.append({"prompt": a["messages"][-2:-1], "chosen": a["messages"][-1:], "rejected": b["messages"][-1:],
                     **({"margin": i / 4} if i % 2 else {})})
    return rows


def prompts(n: int) -> list[dict]:
    return [{"prompt": c["messages"][-2:-1], "answer": c["messages"][-1]["content"]} for c in chats(n, 5)]


CUT = {"messages": 12, "prompt_completion": 4, "text": 4, "preference": 8}  # --max-length: some cut, some dropped
KINDS = {"messages": chats, "prompt_completion": completions, "text": texts, "preference": preferences,
         "prompt": prompts}


def plain(tokenized) -> list:
    """A set's samples and counts as plain values (tensors as lists, their dtype kept)."""
    def value(v):
        return (str(v.dtype), v.tolist()) if isinstance(v, torch.Tensor) else v

    counts = (tokenized.truncated, tokenized.cut_tokens, tokenized.dropped, tokenized.labelled)
    return [counts] + [{k: value(v) for k, v in s.items()} for s in tokenized.samples]


def once(rows, folder, tokenizer=None, kind: str = "messages", **options):
    """(the set, how it was made) as a run's start makes it, with its token cache in `folder`."""
    tokenizer = tokenizer if tokenizer is not None else lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    options = {"tokenize_workers": 1, "token_cache": str(folder), **options}
    return token_cache.tokenized_once(rows, tokenizer, kind, TrainConfig(**options))


@pytest.mark.parametrize("kind", KINDS)
def test_the_tokens_are_the_same_tokenized_here_by_two_processes_or_read_back(kind, tmp_path):
    """Every kind: two forked processes and the cache give the serial tokens and counts (cut and dropped ones too)."""
    rows = KINDS[kind](120)
    options = {"max_length": CUT[kind]} if kind in CUT else {}
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    serial = plain(chat.Tokenized(rows, tokenizer, kind, **options))
    parallel, made = once(rows, tmp_path, tokenizer, kind, tokenize_workers=2, **options)
    assert (made.workers, made.read, made.kept) == (2, False, True)
    read, again = once(rows, tmp_path, tokenizer, kind, **options)
    assert again.read
    off, not_kept = once(rows, tmp_path / "off", tokenizer, kind, tokenize_workers=2, token_cache="off", **options)
    assert not not_kept.read and not (tmp_path / "off").exists()
    for tokenized in (parallel, read, off):
        assert plain(tokenized) == serial
    truncated, _, dropped, _ = serial[0]
    assert kind == "prompt" or truncated and (dropped or kind == "text")  # some cut, some left with nothing to learn
    assert len(list(tmp_path.glob("*.pt"))) == 1


def test_a_second_start_says_it_read_the_cache(tmp_path):
    """The start line says how the tokens were made: by how many processes, kept where; then read back."""
    rows, evaluation = chats(40), chats(8, 9)
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    first = token_cache.TextSets(tokenizer, TrainConfig(token_cache=str(tmp_path), tokenize_workers=2))
    first(rows, evaluation, "chats.jsonl")
    second = token_cache.TextSets(tokenizer, TrainConfig(token_cache=str(tmp_path)))
    second(rows, evaluation, "chats.jsonl")
    assert first.notes[0] == second.notes[0] and first.notes[0].startswith("chats.jsonl: 40 chat samples tokenized")
    assert first.made.startswith("chats.jsonl: 40 samples tokenized by 2 processes in ")
    assert "; 8 evaluation samples tokenized by 2 processes in " in first.made
    assert f", kept in the token cache ({tmp_path})" in first.made
    assert second.made.startswith("chats.jsonl: 40 samples read from the token cache in ")
    assert "; 8 evaluation samples read from the token cache in " in second.made and second.made.endswith(f"({tmp_path})")


def test_the_key_changes_with_what_changes_tokens_and_with_nothing_else(tmp_path):
    """The same samples (a copy, a datasets.Dataset read again), the tokenizer saved and loaded, and options that
    change no token hit; the data, the template (--chat-template), the tokenizer, --max-length and --train-on-prompt
    each make their own entry."""
    from transformers import AutoTokenizer

    rows = chats(40)
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "gen.jinja").write_text(lm_probe.TEMPLATE_GEN)

    def read(rows=rows, tokenizer=tokenizer, **options) -> bool:
        sets = token_cache.text_sets(TrainConfig(token_cache=str(tmp_path / "cache"), **options), tokenizer)
        sets(rows, None, "rows")
        return " read from the token cache " in sets.made

    assert not read()
    assert read(json.loads(json.dumps(rows)))
    assert read(tokenizer=AutoTokenizer.from_pretrained(tmp_path / "tokenizer"))
    assert read(batch_size=3, lr=0.5, pack=16, truncation="off", tokenize_workers=2)  # no --max-length: nothing cut
    other_vocabulary = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    other_vocabulary.add_tokens(["capital"])
    changes = [{"rows": rows[:-1]}, {"rows": [{"messages": [{**m, "content": m["content"] + " cat"}
                                                            for m in c["messages"]]} for c in rows]},
               {"chat_template": str(tmp_path / "gen.jinja")}, {"tokenizer": other_vocabulary},
               {"max_length": 12}, {"max_length": 200}, {"max_length": 200, "truncation": "off"},
               {"train_on_prompt": True}]
    for change in changes:
        assert not read(**change), change
        assert read(**change), change
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 1 + len(changes)
    assert token_cache.cache_folder("auto") == token_cache.cache_folder(os.environ["ACC_TRAINER_CACHE"])


def test_a_files_dataset_is_keyed_by_its_fingerprint(tmp_path):
    """A parquet file read again hits (its `datasets` fingerprint), and the file written anew does not."""
    import datasets

    from acc_trainer.data.user_data import read_files

    path = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(completions(30)).to_parquet(str(path))
    kind = "prompt_completion"
    assert not once(read_files(str(path), {})[0], tmp_path, kind=kind)[1].read
    tokenized, made = once(read_files(str(path), {})[0], tmp_path, kind=kind)
    assert made.read and plain(tokenized) == plain(chat.Tokenized(completions(30), lm_probe.chat_tokenizer(), kind))
    datasets.Dataset.from_list(completions(31)).to_parquet(str(path))
    assert not once(read_files(str(path), {})[0], tmp_path, kind=kind)[1].read


def test_a_run_then_its_evaluation_and_resume_read_the_cache(main_in_process, tmp_path, monkeypatch):
    """`acc-trainer` tokenizes its JSONL once; `evaluate` on its folder and `--resume` tokenize nothing."""
    lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN).save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats(32)))
    run = tmp_path / "run"
    args = ["--model", "lm_probe:base_model", "--tokenizer", tmp_path / "tokenizer", "--dataset", tmp_path / "chats.jsonl",
            "--dataset-args", json.dumps({"eval": str(tmp_path / "chats.jsonl")}), "--batch-size", 8, "--no-plots",
            "--progress", "none", "--token-cache", tmp_path / "cache", "--output-dir", run, "--checkpoint-every", 1]
    code, _, err = main_in_process(*args, "--max-steps", 2)
    assert code == 0, err
    assert any(" tokenized by " in n and "kept in the token cache" in n for n in summary(run)["notes"])

    def tokenizes(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(chat, "tokenize_range", tokenizes)
    code, out, err = main_in_process("evaluate", run)
    assert code == 0, err
    code, _, err = main_in_process(*args, "--max-steps", 2, "--resume", run / "checkpoints" / "step-00000001")
    assert code == 0, err
    assert summary(run)["resumed_from"] == str(run / "checkpoints" / "step-00000001")
    assert any("32 samples read from the token cache" in n for n in summary(run)["notes"])


def test_an_unreadable_file_is_tokenized_again(tmp_path):
    """A cut file, and a file that holds another set, are tokenized again, said, and replaced."""
    rows = chats(60)
    serial = plain(chat.Tokenized(rows, lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN), "messages"))
    once(rows, tmp_path)
    (file,) = tmp_path.glob("*.pt")
    file.write_bytes(file.read_bytes()[:200])
    tokenized, made = once(rows, tmp_path)
    assert not made.read and made.kept and plain(tokenized) == serial
    assert "the file kept for it was unreadable, " in made.said(False) and made.said(False).endswith("; tokenized again)")
    once(chats(5), tmp_path / "other")
    next((tmp_path / "other").glob("*.pt")).replace(file)
    tokenized, made = once(rows, tmp_path)
    assert not made.read and "with another key" in made.why and plain(tokenized) == serial
    assert once(rows, tmp_path)[1].read


def test_a_bad_sample_in_a_tokenizing_process_is_the_same_line(tmp_path, monkeypatch):
    """The lowest bad sample's one line, as the serial tokenizing raises it, from two processes; kept as that line,
    which the next start (the other processes of a launch) raises without tokenizing. A process that fails otherwise,
    or dies, is an error, never a wait."""
    rows = chats(300)
    rows[45] = {"messages": [{"role": "narrator", "content": "hi"}]}
    rows[30] = {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "ho"}]}
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    with pytest.raises(ConfigError) as serial:
        chat.Tokenized(rows, tokenizer, "messages")
    with pytest.raises(ConfigError) as parallel:
        once(rows, tmp_path, tokenizer, tokenize_workers=2)
    assert str(parallel.value) == str(serial.value) == ("sample 30: message 1 has the role 'wizard'; roles are system, "
                                                        "user, assistant, tool, developer")

    def tokenizes(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as patched:
        patched.setattr(chat, "tokenize_range", tokenizes)
        with pytest.raises(ConfigError) as kept:
            once(rows, tmp_path, tokenizer, tokenize_workers=2)
    assert str(kept.value) == str(serial.value)

    class Failing(list):
        def __getitem__(self, index):
            if index == 100 and len(self) == 150:
                raise OSError("the disk went away")
            if index == 200:
                os._exit(3)  # killed, say for memory
            return super().__getitem__(index)

    with pytest.raises(RuntimeError, match=r"^tokenizing samples 100 to \d+ failed in a tokenizing process: OSError: "
                                           "the disk went away"):
        once(Failing(chats(150)), tmp_path, tokenizer, tokenize_workers=2)
    with pytest.raises(RuntimeError, match="a tokenizing process ended with exit code 3"):
        once(Failing(chats(300)), tmp_path, tokenizer, tokenize_workers=2, token_cache="off")


def _two_processes_say(folder: str) -> None:
    """In each process: what building the workload said of its tokens (or its refusal), for a good and a bad set
    and for fit()'s objects; written into FOLDER/said-RANK.json."""
    from accelerate import PartialState

    from acc_trainer.distributed import processes
    from acc_trainer.workload import components

    said = []
    for name in ("chats.jsonl", "bad.jsonl"):
        cfg = TrainConfig(model="lm_probe:base_model", tokenizer=f"{folder}/tokenizer", dataset=f"{folder}/{name}",
                          token_cache=f"{folder}/cache", batch_size=8, tokenize_workers=2)
        processes.start(cfg)
        try:
            said.append(components.build_workload(cfg).data.notes[-1])
        except ConfigError as e:
            said.append(f"ConfigError: {e}")
    # fit()'s objects (fit starts the process group before it builds them, as here): the same division of the work
    cfg = TrainConfig(token_cache=f"{folder}/cache", tokenize_workers=2)
    job = components.from_objects(torch.nn.Linear(2, 2), lm_probe.conversations(300, 5), None, None, None, cfg=cfg,
                                  tokenizer=lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN))
    said.append(job.data.notes[-1])
    with open(f"{folder}/said-{PartialState().process_index}.json", "w") as f:
        json.dump(said, f)


def test_the_main_process_tokenizes_and_the_others_read_its_file_or_its_error(tmp_path):
    """Two processes (forked from this one): the main one tokenizes (by two processes of its own) and keeps the tokens;
    the other reads them. A bad sample is the same line on both, the other reading the main's refusal instead of a
    wait."""
    from conftest import forked

    lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN).save_pretrained(tmp_path / "tokenizer")
    rows = chats(400)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in rows))
    rows[300] = {"messages": [{"role": "narrator", "content": "hi"}]}
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(c) + "\n" for c in rows))
    forked(_two_processes_say, str(tmp_path), processes=2)
    main, other = (json.loads((tmp_path / f"said-{rank}.json").read_text()) for rank in (0, 1))
    assert main[0].startswith(f"{tmp_path / 'chats.jsonl'}: 400 samples tokenized by 2 processes in ")
    assert other[0].startswith(f"{tmp_path / 'chats.jsonl'}: 400 samples read from the token cache in ")
    assert main[1] == other[1] == ("ConfigError: sample 300: message 0 has the role 'narrator'; roles are system, user, "
                                   "assistant, tool, developer")
    assert main[2].startswith("list: 300 samples tokenized by 2 processes in ")  # fit()'s objects
    assert other[2].startswith("list: 300 samples read from the token cache in "), other[2]
