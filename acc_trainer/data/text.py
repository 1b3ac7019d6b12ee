"""Text as users bring it, turned into token ids and labels with the run's tokenizer: chat (`{"messages": [...]}`),
prompt/completion pairs (text or messages), plain text (`{"text": ...}` or strings), preference pairs (prompt, chosen,
rejected) for DPO, and prompts alone for GRPO (`tokenize_prompt`).

The labels are those TRL 1.16's trainers build, token for token (tests/test_chat.py compares them):
- `messages`: the assistant's tokens. A chat template with `{% generation %}` blocks marks them itself (transformers'
  `return_assistant_tokens_mask`, TRL's `assistant_only_loss`); for any other template each assistant turn is found by
  rendering the conversation before it with the generation prompt and the conversation up to it (a turn that opens the
  conversation: its own text, as it follows a placeholder user turn), its characters mapped onto tokens by their
  offsets (the rule transformers uses for its own spans); the turn's header and a default system prompt stay
  unlabelled. A template that renders earlier turns differently once a later one follows (some drop earlier
  reasoning), or an opening assistant turn differently after a user turn, is refused: give one with generation blocks.
- prompt/completion: the tokens after the common prefix of the prompt tokenized alone (with the generation prompt for
  messages) and of prompt + completion (TRL's completion-only loss); text completions get the EOS token appended as text.
- text: every token, EOS appended.
A chat sample's `tools` (JSON-schema function definitions, or that list as a JSON string, as TRL reads them) go to
every rendering of it, as TRL passes them to `apply_chat_template`; text with tools is refused (no template shows them).
`train_on_prompt` labels every token. `max_length` cuts keep_start (what is cut is counted: the start line says it);
`truncation="off"` refuses a longer sample instead. A sample left with no labelled token is dropped, as TRL does.

The tokenized sets are map-style (`Tokenized`, its tokens held flat), built once where the run's data is built, before
packing, through token_cache.py (tokenized by several processes and kept on disk); unpacked samples of different
lengths are batched by `pad_collate`, preference pairs by `preference_collate`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from ..config import ConfigError, first_line
from .datasets import IGNORE_INDEX
from .kinds import is_stream

ROLES = ("system", "user", "assistant", "tool", "developer")
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for generation blocks


def sample_kind(sample, index: int | None = None) -> str | None:
    """"messages", "prompt_completion", "preference" (prompt + chosen + rejected, or chosen + rejected), "text" (a
    string, or a dict with `text`), or None for a sample that is not text (token ids, tensors, or a dict with
    `input_ids` beside its text: left as they are).
    A pair without `rejected` (or without `chosen`) is one line naming the sample."""
    if isinstance(sample, str):
        return "text"
    if not isinstance(sample, Mapping) or "input_ids" in sample:  # tokenized already: trained as it is
        return None
    where = _where(index)
    if "chosen" in sample or "rejected" in sample:
        if "chosen" not in sample or "rejected" not in sample:
            missing = "rejected" if "chosen" in sample else "chosen"
            raise ConfigError(f"{where}is a preference pair without {missing!r}: a pair holds prompt, chosen and "
                              "rejected (or chosen and rejected conversations sharing their first turns)")
        return "preference"
    if "messages" in sample:
        return "messages"
    if "prompt" in sample and "completion" not in sample:
        return "prompt"  # a prompt alone: what --objective grpo generates from
    if "prompt" in sample or "completion" in sample:
        if "prompt" not in sample:
            raise ConfigError(f"{where}has no 'prompt': prompt/completion data holds both")
        return "prompt_completion"
    if "text" in sample and isinstance(sample["text"], str):
        return "text"
    return None


def tokenize_sample(tokenizer, sample, train_on_prompt: bool = False, max_length: int | None = None,
                    truncation: str = "keep_start", index: int | None = None) -> dict[str, list[int]]:
    """One SFT sample (messages, prompt/completion or text) as `{"input_ids", "labels"}` (lists of ints): the
    labels -100 where the loss leaves a token out (the prompt's, unless `train_on_prompt`). `max_length`: kept from
    the start (`truncation="keep_start"`) or refused (`"off"`)."""
    kind = sample_kind(sample, index)
    if kind not in ("messages", "prompt_completion", "text"):
        raise ConfigError(f"{_where(index)}is not chat, prompt/completion or text data")
    ids, mask = _encode(tokenizer, sample, kind, index)
    labels = list(ids) if train_on_prompt else [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    ids = _cut(ids, max_length, truncation, index)
    return {"input_ids": ids, "labels": labels[:len(ids)]}


def tokenize_prompt(tokenizer, sample: Mapping, max_length: int | None = None, index: int | None = None) -> list[int]:
    """A prompt to generate from (--objective grpo) as TRL's GRPOTrainer tokenizes it: text as it is, messages through
    the template with the generation prompt (and `tools`); no special tokens added, never cut (one line instead)."""
    _check_field(sample, "prompt", index)
    if isinstance(prompt := sample["prompt"], list):
        _check_template(tokenizer, index)
        _check_messages(prompt, index)
        ids = _template_ids(tokenizer, prompt, index, tools=_tools(sample, index, True), add_generation_prompt=True)
    else:
        _need_tokenizer(tokenizer, index)
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not ids or (max_length is not None and len(ids) > max_length):
        raise ConfigError(f"{_where(index)}is a prompt of {len(ids)} tokens: a prompt holds from 1 to --max-length "
                          f"{max_length} tokens (a cut prompt would ask another question)")
    return ids


def tokenize_pair(tokenizer, sample: Mapping, max_length: int | None = None, truncation: str = "keep_start",
                  index: int | None = None) -> dict[str, list[int]]:
    """A preference pair as `prompt_ids`, `chosen_ids`, `rejected_ids`, as TRL's DPOTrainer prepares them: text gets
    the EOS token appended to chosen and rejected; messages go through the chat template (the prompt with the
    generation prompt); the prompt ends where the prompt's tokens stop being a prefix of either whole sequence. A pair
    without a prompt shares its first turns (TRL's extract_prompt). `max_length`: prompt + completion kept from the
    start, or refused with `truncation="off"`."""
    sample_kind(sample, index)
    for field in ("prompt", "chosen", "rejected"):
        _check_field(sample, field, index)
    if isinstance(sample["chosen"], list) != isinstance(sample["rejected"], list):
        raise ConfigError(f"{_where(index)}mixes text and messages: prompt, chosen and rejected are all text or all "
                          "lists of messages")
    prompt, chosen, rejected = _explicit_prompt(sample)
    chat = isinstance(prompt, list)
    if chat and not prompt:
        raise ConfigError(f"{_where(index)}has no prompt, and its chosen and rejected conversations share no first turn "
                          "to take as one: give a prompt")
    if chat != isinstance(chosen, list) or chat != isinstance(rejected, list):
        raise ConfigError(f"{_where(index)}mixes text and messages: prompt, chosen and rejected are all text or all "
                          "lists of messages")
    tools = _tools(sample, index, chat)
    if chat:
        _check_template(tokenizer, index)
        for part in (prompt, chosen, rejected):
            _check_messages(part, index)
        p = _template_ids(tokenizer, prompt, index, tools=tools, add_generation_prompt=True)
        pc, pr = (_template_ids(tokenizer, prompt + part, index, tools=tools) for part in (chosen, rejected))
    else:
        _need_tokenizer(tokenizer, index)
        chosen, rejected = _with_eos(tokenizer, chosen), _with_eos(tokenizer, rejected)
        p, pc, pr = (list(tokenizer(text)["input_ids"]) for text in (prompt, prompt + chosen, prompt + rejected))
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    out = {"prompt_ids": list(p[:n]), "chosen_ids": list(pc[n:]), "rejected_ids": list(pr[n:])}
    if max_length is not None:
        longest = n + max(len(out["chosen_ids"]), len(out["rejected_ids"]))
        _cut([0] * longest, max_length, truncation, index)  # refused when "off"
        out = {"prompt_ids": out["prompt_ids"][:max_length],
               **{k: out[k][:max(0, max_length - n)] for k in ("chosen_ids", "rejected_ids")}}
    return out


def assistant_mask(tokenizer, messages: list, index: int | None = None,
                   tools: list | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, 1 on the assistant's tokens) of a conversation rendered by the tokenizer's chat template, with
    the tool schemas `tools` (`apply_chat_template`'s) in every rendering."""
    if not getattr(tokenizer, "is_fast", False):  # transformers' generation masks and our spans both map characters
        raise ConfigError(f"{_where(index)}holds chat messages, and the tokenizer ({type(tokenizer).__name__}) is not a "
                          "fast one: only a fast tokenizer maps tokens to characters, which finds the assistant's "
                          "tokens; give a fast tokenizer (use_fast=True)")
    if GENERATION.search(_template_text(tokenizer)):
        with _template_errors(index):
            out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    text = _render(tokenizer, messages, index=index, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = _render(tokenizer, messages[:i + 1], index=index, tools=tools)
        if not text.startswith(upto):
            raise _unfindable(index, f"the conversation up to message {i} differently once later turns follow")
        spans.append((_turn_start(tokenizer, messages, i, upto, index, tools), len(upto)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask, k = [], 0
    for start, end in encoded["offset_mapping"]:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(int(k < len(spans) and end > spans[k][0] and end > start))
    return list(encoded["input_ids"]), mask


PLACEHOLDER_TURN = {"role": "user", "content": "hi"}


def _turn_start(tokenizer, messages: list, i: int, upto: str, index: int | None, tools: list | None) -> int:
    """Where assistant message i begins in `upto` (the conversation up to it, rendered): after the conversation
    before it rendered with the generation prompt, so the template's own text (the turn's header, a default system
    prompt) is never the assistant's."""
    if i:
        before = _render(tokenizer, messages[:i], index=index, tools=tools,
                         add_generation_prompt=True)  # what the model is given
        if not upto.startswith(before):
            raise _unfindable(index, f"the conversation before message {i} differently once message {i} follows")
        return len(before)
    # Nothing comes before a conversation's first turn, and transformers renders no empty conversation: the turn's
    # own text is what follows a placeholder user turn with the generation prompt, and `upto` must end with it.
    before = _render(tokenizer, [PLACEHOLDER_TURN], index=index, tools=tools, add_generation_prompt=True)
    after = _render(tokenizer, [PLACEHOLDER_TURN, messages[0]], index=index, tools=tools)
    turn = after[len(before):]
    if not (after.startswith(before) and upto.endswith(turn)):
        raise _unfindable(index, "message 0 (the assistant's, opening the conversation) differently after a user turn")
    return len(upto) - len(turn)


def _unfindable(index: int | None, what: str) -> ConfigError:
    return ConfigError(f"{_where(index)}the chat template renders {what}, so the assistant's tokens cannot be found; "
                       "give a template with {% generation %} blocks (--chat-template FILE)")


def _encode(tokenizer, sample, kind: str, index: int | None) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the loss counts by default) of an SFT sample."""
    chat = kind == "messages" or (kind == "prompt_completion" and isinstance(sample["prompt"], list))
    tools = _tools(sample, index, chat)
    if kind == "messages":
        messages = sample["messages"]
        _check_template(tokenizer, index)
        _check_messages(messages, index)
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{_where(index)}is a conversation with no assistant turn: nothing to learn from it")
        ids, mask = assistant_mask(tokenizer, messages, index, tools)
        if not any(mask):
            raise ConfigError(f"{_where(index).strip()}: the chat template's {{% generation %}} blocks mark none of the "
                              "assistant's tokens")
        return ids, mask
    if kind == "text":
        _need_tokenizer(tokenizer, index)
        text = sample if isinstance(sample, str) else sample["text"]
        ids = list(tokenizer(_with_eos(tokenizer, text))["input_ids"])
        return ids, [1] * len(ids)
    for field in ("prompt", "completion"):
        _check_field(sample, field, index)
    prompt, completion = sample["prompt"], sample["completion"]
    if not completion or (isinstance(completion, str) and not completion.strip()):
        raise ConfigError(f"{_where(index)}has an empty completion: nothing to learn from it")
    if isinstance(prompt, list) != isinstance(completion, list):
        raise ConfigError(f"{_where(index)}mixes text and messages: prompt and completion are both text or both "
                          "lists of messages")
    if isinstance(prompt, list):
        _check_template(tokenizer, index)
        _check_messages(prompt + completion, index)
        prompt_ids = _template_ids(tokenizer, prompt, index, tools=tools, add_generation_prompt=True)
        ids = _template_ids(tokenizer, prompt + completion, index, tools=tools)
    else:
        _need_tokenizer(tokenizer, index)
        completion = _with_eos(tokenizer, completion)
        prompt_ids, ids = list(tokenizer(prompt)["input_ids"]), list(tokenizer(prompt + completion)["input_ids"])
    n = _common_prefix(prompt_ids, ids)
    return ids, [0] * n + [1] * (len(ids) - n)


def _explicit_prompt(sample: Mapping) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected); without a prompt, the turns (or characters) chosen and rejected share."""
    if "prompt" in sample:
        return sample["prompt"], sample["chosen"], sample["rejected"]
    chosen, rejected = sample["chosen"], sample["rejected"]
    n = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and n and chosen[n - 1] == " ":  # TRL: the space goes with the completions
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _cut(ids: list[int], max_length: int | None, truncation: str, index: int | None) -> list[int]:
    if max_length is None or len(ids) <= max_length:
        return list(ids)
    if truncation == "off":
        raise ConfigError(f"{_where(index)}has {len(ids)} tokens, more than --max-length {max_length} (--truncation "
                          "off); raise --max-length, or let --truncation keep_start cut it")
    return list(ids[:max_length])


def _with_eos(tokenizer, text: str) -> str:
    """The text with the EOS token appended as text, unless it ends with it (TRL's rule)."""
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


def _common_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _where(index: int | None) -> str:
    return f"sample {index} " if index is not None else "a sample "


def _need_tokenizer(tokenizer, index: int | None) -> None:
    if tokenizer is None:
        raise ConfigError(f"{_where(index)}is text, and the run has no tokenizer to turn it into tokens: give "
                          "--tokenizer (or fit(tokenizer=...))")


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return " ".join(template.values()) if isinstance(template, Mapping) else template or ""


def _check_template(tokenizer, index: int | None) -> None:
    _need_tokenizer(tokenizer, index)
    if not _template_text(tokenizer):
        raise ConfigError(f"{_where(index)}holds chat messages, and the tokenizer has no chat template to render them: "
                          "give one with --chat-template FILE (a Jinja file), or a tokenizer that has one")


def _check_messages(messages, index: int | None) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{_where(index).strip()}: messages must be a non-empty list of {{role, content}} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ConfigError(f"{_where(index).strip()}: message {i} is not a dict with a role and content")
        if message["role"] not in ROLES:
            raise ConfigError(f"{_where(index).strip()}: message {i} has the role {message['role']!r}; roles are "
                              f"{', '.join(ROLES)}")


def _check_field(sample: Mapping, field: str, index: int | None) -> None:
    """A prompt, completion, chosen or rejected is text or a list of messages (a prompt may be absent)."""
    if field in sample and not isinstance(sample[field], (str, list)):
        raise ConfigError(f"{_where(index)}has a {field} of type {type(sample[field]).__name__}: it is text or a list of "
                          "{role, content} messages")


def _tools(sample, index: int | None, chat: bool) -> list | None:
    """A sample's tool schemas (`tools`): a list of dicts, or that list as a JSON string (how a `datasets` column keeps
    schemas of different shapes; TRL decodes it too). None: the sample has none."""
    tools = sample.get("tools") if isinstance(sample, Mapping) else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise _bad_tools(index, f"a string that is not JSON ({first_line(e)})") from None
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad_tools(index, f"a {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise _bad_tools(index, f"tool {i} is a {type(tool).__name__}")
    if tools and not chat:  # only a chat template writes them into the text
        raise ConfigError(f"{_where(index)}has tools, and its text is not chat messages: the chat template renders "
                          "tools, for messages (or a prompt and completion as messages)")
    return tools


def _bad_tools(index: int | None, what: str) -> ConfigError:
    return ConfigError(f"{_where(index)}has tools that are not a list of dicts ({what}): tools is a list of function "
                       'schemas, {"type": "function", "function": {"name", "description", "parameters"}}, or that '
                       "list as a JSON string")


@contextlib.contextmanager
def _template_errors(index: int | None):
    """The chat template's own errors (a syntax error in a --chat-template file, or the template's raise_exception:
    "roles must alternate", "no system role") as one line naming the sample."""
    from jinja2 import TemplateError

    try:
        yield
    except TemplateError as e:
        raise ConfigError(f"{_where(index)}cannot be rendered by the chat template: {type(e).__name__}: "
                          f"{first_line(e)}") from None


def _render(tokenizer, messages: list, index: int | None = None, **kwargs) -> str:
    with _template_errors(index):
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _template_ids(tokenizer, messages: list, index: int | None = None, **kwargs) -> list[int]:
    with _template_errors(index):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


# --------------------------------------------------------------------------------------------------- the sets


class Tokens:
    """Samples' tokens kept flat (what `Tokenized` is built from, a tokenizing process hands back and the token cache
    keeps): `ids`, each kept sample's tokens one after another (a pair's prompt, chosen and rejected ones); `lengths`,
    theirs (three a pair); `mask`, 1 on the labelled tokens (SFT samples); each kept pair's `margins` where it
    `has_margin`; `counts`: truncated, cut tokens, dropped, labelled."""

    FIELDS = ("ids", "lengths", "mask", "margins", "has_margin")

    def __init__(self, kind: str):
        self.kind, self.counts = kind, [0, 0, 0, 0]
        self.ids, self.lengths, self.mask = array("i"), array("q"), array("b")
        self.margins, self.has_margin = array("d"), array("b")

    def extend(self, other: Tokens) -> Tokens:
        for name in self.FIELDS:
            getattr(self, name).extend(getattr(other, name))
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        return self


def tokenize_range(dataset, tokenizer, kind: str, cut: tuple = (False, None, "keep_start"), start: int = 0,
                   stop: int | None = None) -> Tokens:
    """Samples `start` to `stop` of a map-style set of one `kind`, tokenized (`cut`: train_on_prompt, max_length,
    truncation), as `Tokens`; what a set's every tokenizing process runs, on its part of the set."""
    train_on_prompt, max_length, truncation = cut
    out = Tokens(kind)
    for i in range(start, len(dataset) if stop is None else stop):
        sample = dataset[i]
        if sample_kind(sample, i) != kind:
            raise ConfigError(f"sample {i} is {kind_name(sample_kind(sample, i))} data, and sample 0 is "
                              f"{kind_name(kind)} data: a set holds one kind")
        if kind == "preference":
            _add_pair(out, tokenizer, sample, i, max_length, truncation)
        elif kind == "prompt":
            ids = tokenize_prompt(tokenizer, sample, max_length, i)
            out.ids.extend(ids)
            out.lengths.append(len(ids))
        else:
            _add_sample(out, tokenizer, sample, i, cut)
    return out


def _add_sample(out: Tokens, tokenizer, sample, i: int, cut: tuple) -> None:
    train_on_prompt, max_length, truncation = cut
    whole = tokenize_sample(tokenizer, sample, train_on_prompt, index=i)
    kept = tokenize_sample(tokenizer, sample, train_on_prompt, max_length, truncation, i) \
        if max_length is not None and len(whole["input_ids"]) > max_length else whole
    cut_tokens = len(whole["input_ids"]) - len(kept["input_ids"])
    out.counts[0] += bool(cut_tokens)
    out.counts[1] += cut_tokens
    labelled = sum(t != IGNORE_INDEX for t in kept["labels"][1:])  # the next-token targets the loss counts
    if not labelled:
        out.counts[2] += 1
        return
    out.counts[3] += labelled
    out.ids.extend(kept["input_ids"])
    out.mask.extend(t != IGNORE_INDEX for t in kept["labels"])  # a label is its token or -100
    out.lengths.append(len(kept["input_ids"]))


def _add_pair(out: Tokens, tokenizer, sample, i: int, max_length: int | None, truncation: str) -> None:
    whole = tokenize_pair(tokenizer, sample, index=i)
    kept = tokenize_pair(tokenizer, sample, max_length, truncation, i) if max_length is not None else whole
    cut_tokens = sum(len(whole[k]) - len(kept[k]) for k in whole)
    out.counts[0] += bool(cut_tokens)
    out.counts[1] += cut_tokens
    if not kept["chosen_ids"] or not kept["rejected_ids"]:
        out.counts[2] += 1
        return
    out.counts[3] += len(kept["chosen_ids"]) + len(kept["rejected_ids"])
    for key in PAIR_KEYS:
        out.ids.extend(kept[key])
        out.lengths.append(len(kept[key]))
    out.has_margin.append("margin" in sample)  # reward models' margin column
    out.margins.append(float(sample["margin"]) if "margin" in sample else 0.0)


PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")


class Tokenized(Dataset):
    """A set of text samples tokenized once: SFT samples as `{"input_ids", "labels"}` LongTensors, preference pairs
    as `tokenize_pair`'s lists, GRPO's prompts as `{"prompt_ids", "index", "row"}`. What was cut and dropped is
    counted (`truncated`, `cut_tokens`, `dropped`), and the labelled tokens (`labelled`; a pair's: its
    completions'). Tokenized here from `dataset`, or built from `tokens` (token_cache.py's: read from the cache or
    tokenized by several processes); the tokens are held flat, each sample made when it is read."""

    def __init__(self, dataset, tokenizer, kind: str, train_on_prompt: bool = False, max_length: int | None = None,
                 truncation: str = "keep_start", tokens: Tokens | None = None):
        if tokens is None:
            tokens = tokenize_range(dataset, tokenizer, kind, (train_on_prompt, max_length, truncation))
        self.kind, self.rows = kind, dataset if kind == "prompt" else None  # a prompt's row, for reward functions
        self.truncated, self.cut_tokens, self.dropped, self.labelled = tokens.counts
        self.ids = flat_tensor(tokens.ids, torch.int32)
        self.mask = flat_tensor(tokens.mask, torch.int8).bool()
        self.starts = [0, *itertools.accumulate(tokens.lengths)]
        self.margins = [m if has else None for m, has in zip(tokens.margins, tokens.has_margin)]
        self.fields = len(PAIR_KEYS) if kind == "preference" else 1

    def __len__(self) -> int:
        return (len(self.starts) - 1) // self.fields

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of a set of {len(self)}")
        index %= len(self)
        first = index * self.fields
        spans = [(self.starts[first + k], self.starts[first + k + 1]) for k in range(self.fields)]
        if self.kind == "preference":
            pair = {key: self.ids[a:b].tolist() for key, (a, b) in zip(PAIR_KEYS, spans)}
            return pair if self.margins[index] is None else {**pair, "margin": self.margins[index]}
        (a, b), = spans
        ids = self.ids[a:b].long()
        if self.kind == "prompt":  # its index in the set keys its completions' sampling (objectives/sampling.py)
            return {"prompt_ids": ids, "index": index, "row": dict(self.rows[index])}
        return {"input_ids": ids, "labels": ids.masked_fill(~self.mask[a:b], IGNORE_INDEX)}

    @property
    def samples(self) -> list:
        return [self[i] for i in range(len(self))]


def flat_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(values, dtype=dtype).clone() if len(values) else torch.empty(0, dtype=dtype)


def kind_name(kind: str | None) -> str:
    return {"messages": "chat", "prompt_completion": "prompt/completion"}.get(kind, kind or "token (not text)")


def first_sample(dataset):
    """A map-style set's first sample, or None: no set, a stream, or empty."""
    if dataset is None or is_stream(dataset) or not hasattr(dataset, "__getitem__") or not len(dataset):
        return None
    return dataset[0]


def set_kind_of(dataset) -> str | None:
    """The kind of a map-style set's text samples (its first sample's), or None: not text, a stream, or empty."""
    first = first_sample(dataset)
    return None if first is None else sample_kind(first, 0)


def pad_id(tokenizer) -> int:
    """The padding token: the tokenizer's pad token, else its EOS token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad token nor an EOS token to pad batches with")
    return pad


def load_chat_template(tokenizer, path: str | None):
    """The tokenizer with the Jinja chat template of the file `path` (a copy: the caller's keeps its own)."""
    if path is None or tokenizer is None:
        return tokenizer
    import copy

    try:
        template = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot be read ({first_line(e)})") from None
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


# --------------------------------------------------------------------------------------------------- collates


def pad_collate(pad_id: int) -> Callable:
    """SFT samples `{"input_ids", "labels"}` of any lengths as one batch, right padded to the longest: `input_ids`
    (`pad_id`), `labels` (-100), `attention_mask` (1 on the real tokens)."""

    def collate(samples: list) -> dict[str, torch.Tensor]:
        length = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n] = torch.as_tensor(sample["input_ids"])
            labels[row, :n] = torch.as_tensor(sample["labels"] if "labels" in sample else sample["input_ids"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def preference_collate(pad_id: int, max_length: int | None = None) -> Callable:
    """Preference pairs (`tokenize_pair`'s) as TRL's DataCollatorForPreference batches them: `input_ids` [2B, T], the
    B chosen rows (prompt + chosen) then the B rejected rows, right padded; `attention_mask`; `completion_mask` (1 on
    the completion's tokens); each row kept from its start to `max_length`."""

    def collate(samples: list) -> dict[str, torch.Tensor]:
        rows = []
        for key in ("chosen_ids", "rejected_ids"):
            for s in samples:
                prompt, completion = list(s["prompt_ids"]), list(s[key])
                rows.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
        rows = [(ids[:max_length], mask[:max_length]) for ids, mask in rows]
        length = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
        for row, (seq, mask) in enumerate(rows):
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[row, :len(seq)] = 1
            completion[row, :len(seq)] = torch.tensor(mask, dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
        return batch

    return collate
