"""Streams of text: a stream's samples turned into tokens as it is read (`TokenizedStream`), and a JSON Lines file
read as a stream (`JsonLines`: `--dataset FILE.jsonl --dataset-args '{stream: true}'`).

A stream cannot be tokenized once before the run as a map-style set is (text.py's `Tokenized`, token_cache.py): it
may be larger than memory, or have no end known in advance. So the run's `TextSets` (token_cache.py) hands a stream of
text to `tokenized_sets`, which wraps it in a `TokenizedStream`: it reads the user's stream and hands out each
sample's tokens, made by text.py's `tokenize_range` and `Tokenized` as a map-style set's are (the same labels, cuts
and sample format), leaving out a sample left with no token to learn and counting what it cut. The samples' kind is
the training stream's first sample's. Packing comes after it (packing.py's `PackedStream`), and streams.py serves it
as any stream: every process reads it whole, in the same order, and tokenizes the same samples.

Position (streams.py keeps `{epoch, samples, state}` in checkpoints, `samples` counting what the loader counted):
a `TokenizedStream` hands out fewer samples than it reads when it drops one, so the count of tokenized samples says
nothing about where the user's stream stands. Where the user's stream saves its own position (`state_dict`, and no
shuffle buffer: streams.saves_position), the wrapper's state is that position after the sample that made the last
tokens handed out (a sample dropped before it was read and stays read), which the loader takes right after each step:
a resumed run loads it and tokenizes nothing again. Otherwise the wrapper offers no state, and a resumed run reads
the epoch again from its start, tokenizes it and skips the samples consumed, which lands on the same sample because
tokenizing and dropping are the same in every pass.
"""

from __future__ import annotations

import json

from torch.utils.data import IterableDataset

from ..config import ConfigError, TrainConfig, first_line
from .kinds import is_stream
from .streams import first, saves_position, start_epoch
from .text import Tokenized, first_sample, kind_name, sample_kind, tokenize_range


def json_line(line: str | bytes, number: int, path: str):
    """One line of a JSON Lines file as its sample; one line naming it when it is not JSON."""
    try:
        return json.loads(line)
    except ValueError as e:
        raise ConfigError(f"--dataset {path}: line {number} is not JSON ({first_line(e)})") from None


class JsonLines(IterableDataset):
    """A JSON Lines file as a stream: one sample a line (blank lines left out), parsed as it is read and not held.
    Each `iter()` reads from the file's start, or from the position `load_state_dict` gave it (the byte offset after
    the last sample handed out: a resumed run reads nothing again). Its length is its lines that are not blank,
    counted when first asked (one read of the file, nothing parsed)."""

    def __init__(self, path: str):
        self.path = str(path)
        self._length: int | None = None
        self._at = {"offset": 0, "line": 0}  # after the last sample handed out
        self._resume: dict | None = None  # where the next iter() starts

    def __iter__(self):
        start, self._resume = self._resume or {"offset": 0, "line": 0}, None
        offset, number = start["offset"], start["line"]
        self._at = dict(start)
        with open(self.path, "rb") as file:
            file.seek(offset)
            for line in file:
                offset, number = offset + len(line), number + 1
                if line.strip():
                    sample = json_line(line, number, self.path)
                    self._at = {"offset": offset, "line": number}
                    yield sample

    def state_dict(self) -> dict:
        return dict(self._at)

    def load_state_dict(self, state: dict) -> None:
        self._resume = {"offset": int(state["offset"]), "line": int(state["line"])}

    def __len__(self) -> int:
        if self._length is None:
            with open(self.path, "rb") as file:
                self._length = sum(1 for line in file if line.strip())
        return self._length


class TokenizedStream(IterableDataset):
    """`stream`'s text samples of `kind` as their tokens, tokenized as they are read with `tokenizer` and `cut`
    (train_on_prompt, max_length, truncation: text.tokenize_range's); `name` says which stream in its lines ("the
    training stream of ..."). What was cut and dropped is counted as `Tokenized` counts it (`truncated`, `cut_tokens`,
    `dropped`, `labelled`), over the pass read last (in the process that reads it: the reader's worker process with
    --num-workers 1). No length: a dropped sample changes it (a stream's is learnt in its first epoch). `set_epoch`
    reaches the user's stream."""

    def __init__(self, stream, tokenizer, kind: str, cut: tuple, name: str):
        self.stream, self.tokenizer, self.kind, self.cut, self.name = stream, tokenizer, kind, cut, name
        self.read = self.truncated = self.cut_tokens = self.dropped = self.labelled = 0
        self._start = 0  # the number of the first sample the next pass reads (a loaded position)

    def set_epoch(self, epoch: int) -> None:
        start_epoch(self.stream, epoch)

    def __iter__(self):
        start, self._start = self._start, 0
        self.read, self.truncated, self.cut_tokens, self.dropped, self.labelled = start, 0, 0, 0, 0
        for sample in self.stream:
            try:  # sample `read` of the epoch: its number in the lines of a sample that is refused
                tokens = tokenize_range(_One(sample), self.tokenizer, self.kind, self.cut, self.read, self.read + 1)
            except ConfigError as e:
                raise ConfigError(f"{self.name}: {e}") from None
            self.read += 1
            counts = [a + b for a, b in zip((self.truncated, self.cut_tokens, self.dropped, self.labelled), tokens.counts)]
            self.truncated, self.cut_tokens, self.dropped, self.labelled = counts
            if tokens.lengths:  # else dropped: no token to learn left
                yield Tokenized(None, self.tokenizer, self.kind, tokens=tokens)[0]
        if not start and self.read and self.dropped == self.read:
            raise ConfigError(f"{self.name} has no sample left with a token to learn (each of its {self.read:,} was cut "
                              f"to --max-length {self.cut[1]} before its completion)")


class _One:
    """One sample, whatever index it is asked for: tokenize_range reads sample i of a set."""

    def __init__(self, sample):
        self.sample = sample

    def __getitem__(self, index: int):
        return self.sample


class _Positioned(TokenizedStream):
    """A TokenizedStream of a stream that saves its position: the position is the stream's own (and the number of
    samples read, which names a refused sample after a resume as it would be named without one)."""

    def state_dict(self) -> dict:
        return {"samples": self.read, "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self._start = state["samples"]


def tokenized_stream(stream, tokenizer, kind: str, cut: tuple, name: str) -> TokenizedStream:
    """`stream` tokenized as it is read (see TokenizedStream), with a saved position where `stream` has one."""
    return (_Positioned if saves_position(stream) else TokenizedStream)(stream, tokenizer, kind, cut, name)


def tokenized_sets(train, eval_, name: str, tokenizer, cfg: TrainConfig) -> tuple[str | None, str | None, tuple]:
    """TextSets' sets when either is a stream: (the text kind, the start line's note, (train, eval)). The kind is the
    training set's first sample's (None: not text, and the sets pass as they are); a stream of it is tokenized as it
    is read, a map-style set beside it (`Tokenized`) at once. GRPO's prompts are refused: their sampling is keyed by
    each prompt's index in a map-style set."""
    head = first(train, 1, f"the training stream of {name}") if is_stream(train) else [first_sample(train)]
    kind = sample_kind(head[0], 0) if head and head[0] is not None else None
    if kind is None:
        return None, None, (train, eval_)
    if kind == "prompt":
        raise ConfigError(f"the data of {name} is prompts, streamed: --objective grpo generates from a map-style set "
                          "of prompts (a list, a datasets.Dataset, or --dataset FILE without stream)")
    cut = (cfg.train_on_prompt, cfg.max_length, cfg.truncation)
    sets = tuple(None if s is None else tokenized_stream(s, tokenizer, kind, cut, f"the {split} stream of {name}")
                 if is_stream(s) else Tokenized(s, tokenizer, kind, *cut)
                 for split, s in (("training", train), ("evaluation", eval_)))
    what = "every token (--train-on-prompt)" if cfg.train_on_prompt and kind != "preference" else LOSS_ON[kind]
    cuts = f"; what --max-length {cfg.max_length} cuts is counted as they are read" if cfg.max_length is not None else ""
    return kind, f"{name}: {kind_name(kind)} samples streamed, tokenized as they are read, the loss on {what}{cuts}", sets


LOSS_ON = {"messages": "the assistant's tokens", "prompt_completion": "the completions' tokens", "text": "every token",
           "preference": "chosen and rejected completions"}

