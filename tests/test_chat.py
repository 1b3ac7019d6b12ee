"""Chat, instruction and text data as users have them (docs/language-models.md#chat-and-instruction-data): the
labels equal those TRL's SFTTrainer builds, token for token (completion-only loss for prompt/completion data,
assistant-only loss for messages, with a chat template with generation blocks and one without, whoever opens the
conversation, with a default system prompt or without, tool-calling conversations with their `tools`); lists,
`datasets.Dataset`, JSONL, parquet and save_to_disk folders train, packed or padded by the built-in collate, with what
--max-length cuts counted; bad input is one line.
1 vs 2 processes vs accumulation on chat data: tests/test_language_models.py (lm_probe's chat jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

import lm_probe  # noqa: E402 - after the skips
from conftest import summary  # noqa: E402

from acc_trainer.config import ConfigError, TrainConfig  # noqa: E402
from acc_trainer.data import packing, token_cache  # noqa: E402
from acc_trainer.data import text as chat  # noqa: E402


def pairs(n: int, seed: int, conversational: bool) -> list[dict]:
    """Prompt/completion pairs: a chat's last user turn (with its system message, if any) and the answer."""
    rows = []
    for c in lm_probe.conversations(n, seed):
        messages = c["messages"]
        prompt = [m for m in messages[:-1] if m["role"] == "system"] + [messages[-2]]
        if conversational:
            rows.append({"prompt": prompt, "completion": [messages[-1]]})
        else:
            rows.append({"prompt": messages[-2]["content"], "completion": " " + messages[-1]["content"]})
    return rows


def trl_rows(rows, tokenizer, tmp_path, **config) -> list[dict]:
    """TRL's prepared samples (input_ids, labels) for `rows`: the SFTTrainer is built, not trained."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", max_steps=0, use_cpu=True, bf16=False,
                     save_strategy="no", logging_strategy="no", **config)
    trainer = SFTTrainer(model=lm_probe.base_model(), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)
    return [{k: trainer.train_dataset[i][k] for k in ("input_ids", "labels")} for i in range(len(trainer.train_dataset))]


def ours(rows, tokenizer, **options) -> chat.Tokenized:
    return token_cache.TextSets(tokenizer, TrainConfig(**options))(rows, None, "rows")[0]


def with_and_without_generation_blocks(template: str) -> tuple[str, str]:
    return template, template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


DEFAULT_SYSTEM = "<|im_start|>system\nyou are a helpful assistant<|im_end|>\n"
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
TEMPLATES = {  # (with generation blocks, without)
    "im": (lm_probe.TEMPLATE_GEN, lm_probe.TEMPLATE_PLAIN),
    # Qwen2's shape: a default system prompt before a first message that is not the system's, inside the loop.
    "default system in the loop": with_and_without_generation_blocks(lm_probe.TEMPLATE_GEN.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}" + DEFAULT_SYSTEM + "{% endif %}")),
    # Qwen2.5's shape: the same prompt before the loop, from messages[0].
    "default system before the loop": with_and_without_generation_blocks(
        "{% if messages[0]['role'] != 'system' %}" + DEFAULT_SYSTEM + "{% endif %}" + lm_probe.TEMPLATE_GEN),
    "Qwen2.5's own, and TRL's training version of it": tuple(
        (TRL_TEMPLATES / name).read_text() for name in ("qwen2_5_training.jinja", "qwen2_5.jinja")),
}
SHAPES = {
    "opens with the assistant": [("assistant", "hello there")],
    "opens with the assistant, two turns": [("assistant", "hello"), ("user", "say red"), ("assistant", "red")],
    "a system turn, then the assistant": [("system", "you are a cat"), ("assistant", "hello"), ("user", "no"),
                                          ("assistant", "sky blue")],
    "multi-turn with a system turn": [("system", "be short"), ("user", "name a colour"), ("assistant", "blue"),
                                      ("user", "what"), ("assistant", "red")],
    "opens with the user": [("user", "say hello"), ("assistant", "hello")],
}


def opening_with_the_assistant(conversation: dict) -> dict:
    """The conversation without its first user turn: the assistant speaks first (after the system, if any)."""
    messages = conversation["messages"]
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return {"messages": messages[:first_user] + messages[first_user + 1:]}


def test_the_assistants_tokens_for_every_template_shape():
    """The assistant's tokens are its words and its <|im_end|>, never the template's own text (the assistant's
    header, a default system prompt), with generation blocks and without, whoever opens the conversation."""
    for name, (with_blocks, without_blocks) in TEMPLATES.items():
        gen, plain = lm_probe.chat_tokenizer(with_blocks), lm_probe.chat_tokenizer(without_blocks)
        for shape, turns in SHAPES.items():
            messages = [{"role": role, "content": content} for role, content in turns]
            answers = [t for role, content in turns if role == "assistant" for t in [*content.split(), "<|im_end|>"]]
            marked = chat.assistant_mask(gen, messages)
            assert chat.assistant_mask(plain, messages) == marked, (name, shape)
            ids, mask = marked
            assert ids == gen.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            assert [t for t, m in zip(gen.convert_ids_to_tokens(ids), mask) if m] == answers, (name, shape)


def test_labels_are_trls_token_for_token(tmp_path):
    gen, plain = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_GEN), lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    messages = lm_probe.conversations(24, 3)
    cases = [  # (what, our samples, TRL's)
        ("prompt/completion text", ours(pairs(12, 4, False), gen), trl_rows(pairs(12, 4, False), gen, tmp_path)),
        ("prompt/completion chat", ours(pairs(12, 5, True), plain), trl_rows(pairs(12, 5, True), gen, tmp_path)),
    ]
    reference = trl_rows(messages, gen, tmp_path, assistant_only_loss=True)
    # TRL refuses assistant_only_loss for a template without generation blocks it does not know: the same template
    # with them marks what ours must find by rendering each conversation prefix by prefix.
    cases += [("messages, generation blocks", ours(messages, gen), reference),
              ("messages, no generation blocks", ours(messages, plain), reference)]
    cut = trl_rows(messages, gen, tmp_path, assistant_only_loss=True, max_length=12)
    cases.append(("messages cut at 12 tokens", ours(messages, plain, max_length=12), cut))
    # The same conversations, and each opening with the assistant, under this template and under those that add a
    # default system prompt.
    shaped = messages + [opening_with_the_assistant(c) for c in messages]
    for name in ("im", "default system in the loop", "Qwen2.5's own, and TRL's training version of it"):
        with_blocks, without_blocks = (lm_probe.chat_tokenizer(t) for t in TEMPLATES[name])
        reference = trl_rows(shaped, with_blocks, tmp_path, assistant_only_loss=True)
        cases += [(f"{name}, every shape, generation blocks", ours(shaped, with_blocks), reference),
                  (f"{name}, every shape, no generation blocks", ours(shaped, without_blocks), reference)]
    for what, mine, theirs in cases:
        assert [{k: s[k].tolist() for k in s} for s in mine.samples] == theirs, what
        labelled = sum(sum(t != -100 for t in s["labels"][1:]) for s in theirs)
        assert mine.labelled == labelled > 0, what
        batch, trl_batch = chat.pad_collate(gen.pad_token_id)(mine.samples), trl_collate(gen, theirs)
        assert all(torch.equal(batch[k], trl_batch[k]) for k in ("input_ids", "labels", "attention_mask")), what
    # --max-length 12 cut 17 conversations and dropped the 2 left with none of the assistant's tokens, as TRL did
    truncated = ours(messages, plain, max_length=12)
    assert (truncated.truncated, truncated.dropped, len(truncated)) == (17, 2, len(cut)) == (17, 2, 24 - 2)
    whole = ours(messages, plain)
    assert truncated.cut_tokens == sum(len(s["input_ids"]) - 12 for s in whole.samples if len(s["input_ids"]) > 12)
    everything = ours(pairs(12, 4, False), gen, train_on_prompt=True)
    assert all(torch.equal(s["labels"], s["input_ids"]) for s in everything.samples)


def trl_collate(tokenizer, rows):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)(rows)


def test_packed_chat_keeps_only_the_assistants_labels():
    """--pack on chat and prompt/completion data: every labelled token is still labelled in the blocks, and no
    other."""
    tokenizer = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN)
    for tokenized in (ours(lm_probe.conversations(24, 3), tokenizer), ours(pairs(24, 4, True), tokenizer)):
        blocks = packing.pack(tokenized, 32)
        assert sum(int((blocks[i]["labels"] != -100).sum()) for i in range(len(blocks))) == tokenized.labelled
        assert sorted(t for i in range(len(blocks)) for t in blocks[i]["labels"].tolist() if t != -100) == \
            sorted(t for s in tokenized.samples for t in s["labels"][1:].tolist() if t != -100)


def schema(name: str, description: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "the city"}}, "required": ["city"]}}}


def call(name: str, city: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"city": city}}}


# Two functions of one shape: a `datasets` column (TRL's input) keeps them as they are, adding no null fields.
TOOLS = [schema("get_weather", "Get the weather in a city"), schema("get_time", "Get the local time in a city")]
WEATHER = {"role": "user", "content": "what is the weather in paris"}
TOOL_CHATS = [
    {"tools": TOOLS, "messages": [WEATHER, {"role": "assistant", "tool_calls": [call("get_weather", "paris")]},
                                  {"role": "tool", "content": "sunny"},
                                  {"role": "assistant", "content": "it is sunny in paris"}]},
    # Two calls in one turn, their results in one user turn (Qwen2.5 merges consecutive tool messages), then more.
    {"tools": TOOLS, "messages": [
        {"role": "system", "content": "be short"}, {"role": "user", "content": "weather and time in rome"},
        {"role": "assistant", "content": "let me look",
         "tool_calls": [call("get_weather", "rome"), call("get_time", "rome")]},
        {"role": "tool", "content": "rain"}, {"role": "tool", "content": "noon"},
        {"role": "assistant", "content": "rain at noon"}, {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "you are welcome"}]},
    # The assistant opens the conversation: its turn is found after a placeholder user turn, the tools rendered too.
    {"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [call("get_time", "oslo")]},
                                  {"role": "tool", "content": "midnight"},
                                  {"role": "assistant", "content": "it is midnight in oslo"}]},
    {"messages": [WEATHER, {"role": "assistant", "content": "i cannot tell"}]},  # no tools beside ones with them
]
TOOL_PAIRS = [{"tools": TOOLS, "prompt": c["messages"][:-1], "completion": c["messages"][-1:]} for c in TOOL_CHATS[:2]]


def tool_tokenizer(template: str):
    """lm_probe's word-level tokenizer with a vocabulary of every word `template` writes for TOOL_CHATS, the tools'
    schemas and Qwen2.5's tool instructions among them, so that no word of the tools decodes as [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    renderer, split = lm_probe.chat_tokenizer(template), pre_tokenizers.Whitespace()
    specials = ["[UNK]", "[PAD]", "[EOS]", "<|im_start|>", "<|im_end|>"]
    words = dict.fromkeys(word for c in TOOL_CHATS for word, _ in split.pre_tokenize_str(
        renderer.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=False)))
    vocabulary = [*specials, *(w for w in words if w not in specials)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary)}, unk_token="[UNK]"))
    tok.pre_tokenizer = split
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
                                   additional_special_tokens=specials[3:])
    fast.chat_template = template
    return fast


def trl_pairs(rows, tokenizer, tmp_path) -> list[dict]:
    """TRL's DPOTrainer's prepared pairs (prompt_ids, chosen_ids, rejected_ids): the trainer is built, not trained."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl-dpo"), report_to="none", max_steps=0, use_cpu=True, bf16=False,
                     logging_strategy="no", save_strategy="no")
    trainer = DPOTrainer(model=lm_probe.base_model(), ref_model=lm_probe.base_model(), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    return [{k: trainer.train_dataset[i][k] for k in keys} for i in range(len(trainer.train_dataset))]


def test_tools_are_in_the_tokens_and_only_the_assistant_is_labelled(tmp_path):
    """A sample's `tools` reach the chat template (Qwen2.5's, which writes their schemas into the system turn): their
    text is in the tokens, none of them labelled; the assistant's tool calls are labelled, the tools' results are
    not: TRL's labels token for token, with generation blocks and without, for messages and prompt/completion
    messages, and TRL's DPOTrainer's tokens for a preference pair with tools."""
    with_blocks, without_blocks = (tool_tokenizer(t) for t in TEMPLATES["Qwen2.5's own, and TRL's training version of it"])
    descriptions = [tool["function"]["description"] for tool in TOOLS]
    for tokenizer in (with_blocks, without_blocks):
        for conversation, sample in zip(TOOL_CHATS, ours(TOOL_CHATS, tokenizer).samples, strict=True):
            ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
            decoded, given = tokenizer.decode(ids), "tools" in conversation
            assert [d in decoded for d in descriptions] == [given] * len(TOOLS), f"tools given: {given}; {decoded!r}"
            if not given:
                continue
            text = tokenizer.apply_chat_template(conversation["messages"], tools=TOOLS, tokenize=False)
            words = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            assert ids == words["input_ids"]
            # The tools' schemas as the template writes them (tojson) and the tools' results: their tokens in the
            # input, none of them labelled; the functions called are.
            quoted = [json.dumps(tool) for tool in TOOLS] + [f"<tool_response>\n{m['content']}\n</tool_response>"
                                                             for m in conversation["messages"] if m["role"] == "tool"]
            spans = [(text.index(q), text.index(q) + len(q)) for q in quoted]
            quiet = [any(a <= start and end <= b for a, b in spans) for start, end in words["offset_mapping"]]
            assert sum(quiet) > len(quoted) and not any(label != -100 for label, q in zip(labels, quiet) if q)
            called = {c["function"]["name"] for m in conversation["messages"] for c in m.get("tool_calls", [])}
            assert called <= set(tokenizer.convert_ids_to_tokens([t for t in labels if t != -100]))
    reference = trl_rows(TOOL_CHATS, with_blocks, tmp_path, assistant_only_loss=True)
    pairs_reference = trl_rows(TOOL_PAIRS, with_blocks, tmp_path)
    for what, mine, theirs in [("messages, generation blocks", ours(TOOL_CHATS, with_blocks), reference),
                               ("messages, no generation blocks", ours(TOOL_CHATS, without_blocks), reference),
                               ("prompt/completion messages", ours(TOOL_PAIRS, without_blocks), pairs_reference)]:
        assert [{k: s[k].tolist() for k in s} for s in mine.samples] == theirs, what
    as_json = [{**c, "tools": json.dumps(c["tools"])} for c in TOOL_CHATS[:-1]]  # how a dataset may keep them
    assert [s["input_ids"].tolist() for s in ours(as_json, without_blocks).samples] == \
        [s["input_ids"] for s in reference[:-1]]
    preference_rows = [{"tools": TOOLS, "prompt": [WEATHER], "chosen": TOOL_CHATS[0]["messages"][1:2],
                        "rejected": [{"role": "assistant", "content": "i cannot tell"}]}]
    pair = chat.tokenize_pair(without_blocks, preference_rows[0], index=0)
    assert "Get the weather in a city" in without_blocks.decode(pair["prompt_ids"])
    assert [pair] == trl_pairs(preference_rows, without_blocks, tmp_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tokenizer folder, chats in JSONL, prompt/completion pairs in parquet, text in a save_to_disk folder."""
    import datasets

    folder = tmp_path_factory.mktemp("files")
    lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN).save_pretrained(folder / "tokenizer")
    (folder / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in lm_probe.conversations(32, 0)))
    datasets.Dataset.from_list(pairs(32, 1, False)).to_parquet(str(folder / "pairs.parquet"))
    texts = [c["messages"][-1]["content"] for c in lm_probe.conversations(48, 2)]
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": texts[:40]}),
                         validation=datasets.Dataset.from_dict({"text": texts[40:]})).save_to_disk(folder / "texts")
    return folder


def test_files_of_every_kind_train_padded_or_packed(files, main_in_process, train_in_process, tmp_path):
    """Chats from JSONL named on the command line, packed and cut at --max-length; prompt/completion pairs from
    parquet, padded by the built-in collate; text from a save_to_disk folder with its validation split, packed."""
    common = dict(model="lm_probe:base_model", tokenizer=str(files / "tokenizer"), batch_size=8, max_steps=2,
                  plots=False)
    code, _, err = main_in_process("--dataset", files / "chats.jsonl", "--pack", 32, "--max-length", 12,
                                   "--model", common["model"], "--tokenizer", common["tokenizer"], "--batch-size", 8,
                                   "--max-steps", 2, "--no-plots", "--progress", "none", "--output-dir",
                                   tmp_path / "chats")
    assert code == 0, err
    whole = ours(lm_probe.conversations(32, 0), lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN))
    cut = ours(lm_probe.conversations(32, 0), lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN), max_length=12)
    note = (f"{files / 'chats.jsonl'}: {len(cut)} chat samples tokenized, the loss on the assistant's tokens "
            f"({cut.labelled:,} labelled tokens); {cut.truncated} cut to --max-length 12 ({cut.cut_tokens:,} tokens cut); "
            f"{cut.dropped} dropped, with no token to learn left")
    assert note in summary(tmp_path / "chats")["notes"]
    assert cut.labelled < whole.labelled and cut.truncated and cut.dropped
    # The counts said, from the template's own renderings: the conversations longer than 12 tokens, and what is past 12.
    lengths = [len(lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN).apply_chat_template(c["messages"], tokenize=True,
                                                                                         return_dict=True)["input_ids"])
               for c in lm_probe.conversations(32, 0)]
    assert cut.truncated == sum(n > 12 for n in lengths) and cut.cut_tokens == sum(max(0, n - 12) for n in lengths)
    parquet = train_in_process(dataset=str(files / "pairs.parquet"), dataset_args={"eval": str(files / "pairs.parquet")},
                               eval_every=1, **common)
    assert [e["samples"] for e in parquet["evals"]] == [32, 32]
    assert any("32 prompt/completion samples tokenized, the loss on the completions' tokens" in n for n in parquet["notes"])
    texts = train_in_process(dataset=str(files / "texts"), pack=16, **common)
    assert texts["evals"][-1]["samples"] > 0 and any("40 text samples tokenized" in n for n in texts["notes"])


def test_bad_input_is_one_line(files, main_in_process, tmp_path):
    """Each mistake in text data is a ConfigError naming the sample from Python, one line and exit 2 from the CLI."""
    import acc_trainer

    tokenizer = lm_probe.chat_tokenizer()
    chats = lm_probe.conversations(8, 0)
    user, answer = chats[0]["messages"][-2:]
    # A template that refuses what it cannot render (as many do), and one with a syntax error.
    strict = lm_probe.chat_tokenizer("{{ raise_exception('roles must alternate') }}" + lm_probe.TEMPLATE_GEN)
    broken = lm_probe.chat_tokenizer("{% for m in messages %}{{ m['content'] }")
    # Without generation blocks, one that renders an assistant turn differently after a user's (as Qwen3 shows the
    # reasoning after the last user turn only): where an opening assistant turn starts cannot be told.
    thinking = lm_probe.chat_tokenizer(lm_probe.TEMPLATE_PLAIN.replace(
        "assistant\n{{ m['content'] }}", "assistant\n{% if not loop.first %}<think></think>{% endif %}{{ m['content'] }}"))
    mistakes = {
        "sample 1: message 0 has the role 'narrator'": (
            [chats[0], {"messages": [{"role": "narrator", "content": "hello"}, answer]}], tokenizer),
        "sample 1 is a conversation with no assistant turn": ([chats[0], {"messages": [user]}], tokenizer),
        "sample 0 holds chat messages, and the tokenizer has no chat template": (chats, lm_probe.chat_tokenizer(None)),
        "sample 2 has an empty completion": (pairs(2, 0, False) + [{"prompt": "say", "completion": ""}], tokenizer),
        "sample 0 is text, and the run has no tokenizer": ([{"text": "hello there"}], None),
        "sample 0 is text, and the run has no tokenizer ": (["hello there"], None),
        "sample 1 is a preference pair without 'rejected'": (
            [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}], tokenizer),
        "sample 1 has a completion of type int": (pairs(2, 0, False)[:1] + [{"prompt": "say", "completion": 5}],
                                                  tokenizer),
        "sample 0 has a chosen of type NoneType": ([{"prompt": "a", "chosen": None, "rejected": "c"}], tokenizer),
        "sample 0 has no prompt, and its chosen and rejected conversations share no first turn": (
            [{"chosen": [user, answer], "rejected": [answer]}], tokenizer),
        "sample 1 has tools that are not a list of dicts (a dict)": ([chats[0], {**chats[1], "tools": TOOLS[0]}],
                                                                     tokenizer),
        "sample 0 has tools that are not a list of dicts (tool 1 is a str)": (
            [{**chats[0], "tools": [TOOLS[0], "get_time"]}], tokenizer),
        "sample 0 has tools that are not a list of dicts (a string that is not JSON": (
            [{**chats[0], "tools": "get_time"}], tokenizer),
        "sample 0 has tools, and its text is not chat messages": (
            [{"prompt": "say", "completion": " hello", "tools": TOOLS}], tokenizer),
        "sample 0 cannot be rendered by the chat template: TemplateError: roles must alternate": (
            chats, strict),
        "sample 0 cannot be rendered by the chat template: TemplateSyntaxError": (chats, broken),
        "sample 0 the chat template renders message 0 (the assistant's, opening the conversation) differently after "
        "a user turn, so the assistant's tokens cannot be found": ([{"messages": [answer, user, answer]}], thinking),
    }
    for message, (data, given) in mistakes.items():
        with pytest.raises(ConfigError) as raised:
            acc_trainer.fit(lm_probe.base_model(), data, tokenizer=given, batch_size=1, max_steps=1, progress="none",
                            output_dir=str(tmp_path / "never"))
        assert str(raised.value).startswith(message.strip()), str(raised.value)
    assert not (tmp_path / "never").exists()
    with pytest.raises(ConfigError, match="^sample 0 has 24 tokens, more than --max-length 8 "):
        chat.tokenize_sample(tokenizer, chats[0], max_length=8, truncation="off", index=0)
    code, out, err = main_in_process("--dataset", files / "chats.jsonl", "--model", "lm_probe:base_model",
                                     "--tokenizer", files / "tokenizer", "--max-length", 8, "--truncation", "off")
    assert (code, out) == (2, "")
    assert err.startswith("acc-trainer: error: sample 0 has 24 tokens, more than --max-length 8 (--truncation off)")
    assert err.count("\n") == 1
    (tmp_path / "object.json").write_text(json.dumps({"data": chats}, indent=1))
    code, out, err = main_in_process("--dataset", tmp_path / "object.json", "--model", "lm_probe:base_model",
                                     "--tokenizer", files / "tokenizer")
    assert (code, out, err.count("\n")) == (2, "", 1)
    assert "object.json holds one JSON object: a .json dataset is a list of samples" in err
    # Tokens given already, beside the text and tools (as many as each sample had) they came from: trained as given
    # (not tokenized again, the text and tools left out of the batches: 8 samples of 4 tokens, 3 next tokens each).
    given = [{"input_ids": torch.tensor([3, 5, 6, 2]), "labels": torch.tensor([3, 5, 6, 2]), **c,
              "tools": TOOLS[:1 + i % 2]} for i, c in enumerate(chats)]
    assert chat.set_kind_of(given) is None
    trained = acc_trainer.fit(lm_probe.base_model(), given, tokenizer=tokenizer, batch_size=8, max_steps=1,
                              progress="none", plots=False, output_dir=str(tmp_path / "tokens"))
    assert trained["train_samples"] == 8 and not any("tokenized" in note for note in trained["notes"])
