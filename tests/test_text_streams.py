"""Streams of text (docs/language-models.md#streams-of-text, docs/large-data.md): chat, pairs for --objective dpo and
JSON Lines files read as streams are tokenized as they are read, padded or packed, and keep the guarantees of
map-style text: the same weights as the same samples held in memory, on 1 and 2 processes (1e-5), a resume mid-epoch
bit-identical (from the file's saved position, or read again and skipped when packed), packed streams planned as packed
sets are; mistakes in one line.

The runs are tests/text_stream_probe.py's, made once: every job in this process, the streamed ones again on 2
processes forked from it (conftest.forked).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import lm_probe  # noqa: E402 - after the skips
import text_stream_probe as probe  # noqa: E402
from conftest import distance, forked, one_thread, reset_accelerate, summary, weights  # noqa: E402

from acc_trainer.config import ConfigError, TrainConfig  # noqa: E402
from acc_trainer.data import packing, text_streams  # noqa: E402
from acc_trainer.data.token_cache import TextSets  # noqa: E402

STREAMED = ("chat_stream", "datasets_stream", "packed_stream", "dpo_stream", "datasets_more", "jsonl", "jsonl_packed")
# Each stream and the run of the same samples held in memory (one step of the whole set an epoch: the same math).
SAME_SAMPLES = {"chat_stream": "chat_map", "datasets_stream": "chat_map", "packed_stream": "packed_map",
                "dpo_stream": "dpo_map"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text_streams")
    data, one, two = root / "data", root / "one", root / "two"
    probe.write(data)
    reset_accelerate()
    try:
        with one_thread():
            probe.run_jobs(data, one)
    finally:
        reset_accelerate()
    jobs = [*STREAMED, *(f"{job}_resumed" for job in probe.RESUMED)]
    forked(probe.run_jobs, data, two, jobs, processes=2)
    return {"one": one, "two": two, "data": data}


def test_a_stream_of_text_trains_as_the_same_samples_held_in_memory(runs):
    """A user's IterableDataset of chats, a `datasets` stream of the same chats in JSON Lines, a stream packed in blocks
    and a stream of preference pairs for --objective dpo end within 1e-5 of the map-style run of the same samples
    (measured: 5.8e-8 at most), with the same evaluation of every one of the 6 held-out chats."""
    one = runs["one"]
    for stream, held in SAME_SAMPLES.items():
        assert distance(weights(one / stream), weights(one / held)) < 1e-5, stream
        streamed, reference = summary(one / stream), summary(one / held)
        assert streamed["steps"] == reference["steps"] == 3, stream
        assert streamed["train_samples"] == reference["train_samples"], stream
    for stream in ("chat_stream", "datasets_stream"):
        result, reference = summary(one / stream)["eval"], summary(one / "chat_map")["eval"]
        assert summary(one / stream)["eval_samples"] == 6 and abs(result["loss"] - reference["loss"]) < 1e-5
    assert any("chat samples streamed, tokenized as they are read, the loss on the assistant's tokens" in note
               for note in summary(one / "chat_stream")["notes"])
    # The runs trained: the weights compared moved.
    start = lm_probe.base_model().state_dict()
    trained = weights(one / "chat_stream")
    assert max((trained[k] - start[k]).abs().max().item() for k in trained) > 1e-3


def test_streams_of_text_train_alike_on_one_and_two_processes(runs):
    """Every stream of text, padded, packed and in pairs, from Python and from --dataset FILE.jsonl: the same steps and
    evaluation on 2 processes as on 1, the weights within 1e-5 (measured: 1.8e-7 at most)."""
    for job in STREAMED:
        one, two = summary(runs["one"] / job), summary(runs["two"] / job)
        assert distance(weights(runs["one"] / job), weights(runs["two"] / job)) < 1e-5, job
        assert two["world_size"] == 2 and one["steps"] == two["steps"] and one["epochs"] == two["epochs"], job
        assert one["eval_samples"] == two["eval_samples"], job
    assert summary(runs["two"] / "jsonl")["steps"] == 12  # 2 epochs of 48 chats in batches of 8


@pytest.mark.parametrize("where", ["one", "two"])
def test_a_resumed_stream_of_text_is_the_same_run(runs, where):
    """Resumed at step 4, mid-epoch: a JSON Lines stream tokenized as it is read loads the file's saved position (the
    32 chats consumed are not read again), and so does a `datasets` stream of the file; packed, the file is read again
    and the 16 blocks consumed skipped. Each ends bit-identical to the run without a stop, with the same evaluations."""
    out = runs[where]
    for job, how, consumed in (("jsonl", "saved state", 32), ("datasets_more", "saved state", 32),
                               ("jsonl_packed", "skipped", 16)):
        resumed = summary(out / f"{job}_resumed")
        assert distance(weights(out / job), weights(out / f"{job}_resumed")) == 0.0, job
        assert resumed["stream_resume"]["how"] == how and resumed["stream_resume"]["samples"] == consumed, job
        assert resumed["evals"] == summary(out / job)["evals"], job


def text_sets(**options) -> TextSets:
    return TextSets(lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN), TrainConfig(token_cache="off", **options))


def test_a_packed_stream_holds_the_blocks_of_a_packed_set():
    """A stream of documents no longer than a window packs into the very blocks `pack` makes of the same documents
    held in memory; in windows of 5 documents, the same labelled tokens are in more blocks (the same pieces of the
    documents, planned 5 at a time), each starting a document at position 0, and a second pass gives the same blocks
    (a resume's skipping relies on it)."""
    rows = lm_probe.conversations(48, 2)
    held = text_sets()(rows, None, "rows")[0]
    stream = text_sets()(probe.Stream(rows), None, "rows")[0]
    assert isinstance(stream, text_streams.TokenizedStream)
    assert [{k: v.tolist() for k, v in s.items()} for s in stream] == \
        [{k: v.tolist() for k, v in s.items()} for s in held.samples]
    whole = packing.pack(held, 32)
    assert [{k: v.tolist() for k, v in b.items()} for b in packing.pack(stream, 32)] == \
        [{k: v.tolist() for k, v in whole[i].items()} for i in range(len(whole))]
    windowed = packing.pack(stream, 32, window=5)
    blocks = list(windowed)
    assert len(blocks) > len(whole) and all(b["position_ids"][0] == 0 and len(b["input_ids"]) == 32 for b in blocks)
    labelled = sorted(t for i in range(len(whole)) for t in whole[i]["labels"].tolist() if t != -100)
    assert sorted(t for b in blocks for t in b["labels"].tolist() if t != -100) == labelled  # the same pieces
    assert [b["input_ids"].tolist() for b in windowed] == [b["input_ids"].tolist() for b in blocks]
    windowed.set_epoch(3)
    assert stream.stream.epochs[-1] == 3  # through the tokenizing stream to the user's


def test_a_jsonl_stream_reads_its_lines_once_each_and_resumes_from_its_offset(tmp_path):
    """JsonLines: blank lines left out, its length counted, each pass from the start; a loaded position (taken after
    any sample) continues with the next line; a line that is not JSON is one line naming it."""
    rows = lm_probe.conversations(7, 0)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 2 else "") for i, r in enumerate(rows)))
    stream = text_streams.JsonLines(path)
    assert len(stream) == 7 and list(stream) == rows and list(stream) == rows
    for k in range(1, 7):
        reading = iter(stream)
        for _ in range(k):
            next(reading)
        state = json.loads(json.dumps(stream.state_dict()))  # as trainer_state.json keeps it
        stream.load_state_dict(state)
        assert list(stream) == rows[k:], k
    path.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"chats.jsonl: line 2 is not JSON \("):
        list(text_streams.JsonLines(path))


def test_mistakes_in_a_stream_of_text_are_one_line(tmp_path, main_in_process, torch_on_one_thread):
    """A sample of another kind, a stream whose every sample is cut away, prompts (GRPO's, map-style only), samples that
    are neither text nor tokens, and `stream: true` on a file that is not JSON Lines: each one line."""
    import acc_trainer

    chats = lm_probe.conversations(8, 0)
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    mistakes = {
        "the training stream of Stream: sample 3 is prompt/completion data, and sample 0 is chat data: a set holds one "
        "kind": (chats[:3] + [{"prompt": "say", "completion": " hello"}] + chats[3:], {}),
        "the training stream of Stream has no sample left with a token to learn (each of its 8 was cut to --max-length 2":
            (chats, {"max_length": 2}),
        "the data of Stream is prompts, streamed: --objective grpo generates from a map-style set": (
            [{"prompt": "say hello"}] * 8, {}),
        # As for a map-style set: the model named, and what the samples hold.
        "model transformers.models.llama.modeling_llama:LlamaForCausalLM does not take the samples of "
        "text_stream_probe:Stream ({question: (str, str), answer: (str, str)}): ValueError: You must specify exactly "
        "one of input_ids or inputs_embeds": ([{"question": "what is the sky", "answer": "blue"}] * 8, {}),
    }
    for message, (rows, options) in mistakes.items():
        with pytest.raises(ConfigError) as raised:
            acc_trainer.fit(lm_probe.base_model(), probe.Stream(rows), tokenizer=tokenizer, batch_size=2, max_steps=1,
                            progress="none", output_dir=str(tmp_path / "never"), **options)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)
    parquet = tmp_path / "chats.parquet"
    parquet.write_bytes(b"")
    code, out, err = main_in_process("--dataset", parquet, "--dataset-args", "{stream: true}", "--model",
                                     "lm_probe:base_model")
    assert (code, out, err.count("\n")) == (2, "", 1)
    assert "--dataset-args stream: true reads a .jsonl file (one sample a line) as a stream" in err
