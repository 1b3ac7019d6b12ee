"""A run's text sets tokenized once (`TextSets`, where the run's data is built): by several processes, and kept on
disk for every later start on the same data (a resume, `acc-trainer evaluate`, `predict`, `check`, a run with other
training options), which reads them back instead of tokenizing again. The tokens are the same either way: every
process runs text.py's `tokenize_range` on its part of the set, and a set read back is the set written. (Streams of
text are tokenized as they are read, text_streams.py, and never kept.)

- **Where**: `--token-cache auto` (the default) keeps them in $ACC_TRAINER_CACHE, else ~/.cache/acc_trainer/tokens;
  `--token-cache DIR` in DIR; `off` keeps nothing (and reads nothing). One file a set, `<key>.pt`; removing the folder
  clears the cache (nothing else refers to its files).
- **The key** (`entry_key`) is a hash of everything the tokens depend on: the samples (a list or any map-style set:
  their canonical JSON, sorted keys; a `datasets.Dataset` backed by files, as `--dataset` reads parquet and
  `save_to_disk` folders: its fingerprint; one held in memory: its rows' JSON), the tokenizer (its class, its
  tokenizer.json for a fast one or its vocabulary files and scalar settings for a slow one, its special and added
  tokens, padding side, chat template after --chat-template), the set's kind, --max-length, --truncation and
  --train-on-prompt where they change tokens, this format, the tokenizing code (text.py's source) and the versions of
  transformers, tokenizers and jinja2. Anything else (the model, the batch size, the paths the files were read from)
  changes nothing, so those starts hit. A set the key cannot cover (samples that are not JSON, a tokenizer that is
  not a transformers one) is tokenized and not kept, and the note says why.
- **Storage**: a torch file of flat tensors (every kept sample's tokens as int32, their lengths, the labelled
  tokens' mask, pairs' margins) and the counts the start line says (cut, dropped, labelled), written under a
  temporary name and renamed into place, so a reader sees a whole file or none. A prompt set's rows (what reward
  functions take) are the set's own samples, read from it. A file that cannot be read, or does not hold what its name
  says, is tokenized again and replaced, with a note. A set the tokenizing refuses (a bad sample) is kept as its one
  line, raised again at once by whoever reads it (the other processes, the next start on the same data).
- **In parallel**: `--tokenize-workers N` processes (default: the CPU cores, up to 8; shared among the processes of a
  launch that tokenize at once), forked from this one (Linux; elsewhere, and inside a daemonic process, the set is
  tokenized in this process), each tokenizing every N-th chunk of the set; the chunks are put back in order. Forking
  after torch is loaded is safe here: the children run no torch kernels and no OpenMP (the tokens travel back as
  arrays over a pipe), and HF tokenizers' own thread pool turns itself off in a forked child. A sample's error comes
  back as the same one line the serial tokenizing raises (the lowest sample first); a child that dies is an error
  naming it, never a wait.
- **Processes**: the main process tokenizes and writes first; the others wait, then read its file. build_workload
  (and from_objects, fit()'s, which starts the process group first) builds the data inside Accelerate's
  `main_process_first()` (the main process first, the others after its
  barrier), which holds the main process's error until every process has left the barrier, and the others then read
  the refusal it kept: its ConfigError becomes theirs, the same line, with no collective of its own here. The main
  process is the global one: with a cache folder on each machine's own disk, the other machines' processes do not find
  its file and tokenize for themselves (give a shared --token-cache DIR to tokenize once in all).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
import traceback
import uuid
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import Dataset

from ..config import ConfigError, TrainConfig, first_line
from . import text, text_streams
from .kinds import is_stream
from .text import Tokenized, Tokens

FORMAT = 1  # what a cache file holds; a change of it keys every set anew
SFT = ("messages", "prompt_completion", "text")
STORED = {"ids": ("i", torch.int32), "lengths": ("q", torch.int64), "mask": ("b", torch.int8),
          "margins": ("d", torch.float64), "has_margin": ("b", torch.int8)}


class TextSets:
    """Where a run's data is built, before packing: `(train, eval) -> (train, eval)`, their text samples tokenized
    with the run's tokenizer and options (sets that are not text pass as they are). Afterwards `kind` is the text
    kind (None: the data was not text), `collate` the padding collate of unpacked SFT data, `notes` what the start
    line says (`note`: the samples and their labels; then how the tokens were made: tokenized, by how many processes,
    or read from the token cache)."""

    def __init__(self, tokenizer, cfg: TrainConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        self.kind: str | None = None
        self.note: str | None = None
        self.made: str | None = None
        self.sets: list[Tokenized] = []

    def __call__(self, train, eval_, name: str):
        self.made = None  # said again for each call's sets (a mixture calls once a set)
        if is_stream(train) or is_stream(eval_):  # tokenized as they are read (text_streams.py), never kept
            self.kind, self.note, sets = text_streams.tokenized_sets(train, eval_, name, self.tokenizer, self.cfg)
            return sets
        kind = text.set_kind_of(train)
        if kind is None:  # not text; tokens kept beside the text they came from train without it
            return _tokens_only(train), _tokens_only(eval_)
        cfg, self.kind = self.cfg, kind
        made = [tokenized_once(s, self.tokenizer, kind, cfg) for s in (train, eval_) if s is not None]
        self.sets = [tokenized for tokenized, _ in made]
        if not len(self.sets[0]) and kind != "prompt":
            raise ConfigError(f"the training set of {name} has no sample left with a token to learn (each was cut "
                              f"to --max-length {cfg.max_length} before its completion)")
        self.note = self._note(name)
        self.made = f"{name}: " + "; ".join(how.said(evaluation) for evaluation, (_, how) in enumerate(made)) + \
            (f" ({made[0][1].folder})" if made[0][1].folder else "")
        return self.sets[0], self.sets[1] if len(self.sets) > 1 else None

    @property
    def notes(self) -> list[str]:
        return [n for n in (self.note, self.made) if n]

    def collate(self) -> Callable | None:
        """The padding collate for unpacked SFT text data (None: not text data, or packed, or preference pairs)."""
        if self.kind in (None, "preference", "prompt") or self.cfg.pack is not None:
            return None
        return text.pad_collate(text.pad_id(self.tokenizer))

    def _note(self, name: str) -> str:
        train = self.sets[0]
        if self.kind == "prompt":
            return f"{name}: {len(self.sets[0])} prompts tokenized, to generate from"
        what = {"messages": "the assistant's tokens", "prompt_completion": "the completions' tokens",
                "text": "every token", "preference": "chosen and rejected completions"}[self.kind]
        if self.cfg.train_on_prompt and self.kind != "preference":
            what = "every token (--train-on-prompt)"
        note = (f"{name}: {len(train)} {text.kind_name(self.kind)} samples tokenized, the loss on {what} "
                f"({train.labelled:,} labelled tokens)")
        truncated = sum(s.truncated for s in self.sets)
        if truncated:
            note += (f"; {truncated} cut to --max-length {self.cfg.max_length} "
                     f"({sum(s.cut_tokens for s in self.sets):,} tokens cut)")
        dropped = sum(s.dropped for s in self.sets)
        if dropped:
            note += f"; {dropped} dropped, with no token to learn left"
        return note


def text_sets(cfg: TrainConfig, tokenizer=None) -> TextSets:
    """How the run's text becomes tokens: with `tokenizer` (fit's object, or the one --tokenizer names, loaded by
    workload/components.py before the data is built), its chat template replaced by --chat-template's."""
    if cfg.chat_template is not None and tokenizer is None:
        raise ConfigError("--chat-template applies with --tokenizer (or fit(tokenizer=...)): the template is the "
                          "tokenizer's")
    return TextSets(text.load_chat_template(tokenizer, cfg.chat_template), cfg)


TEXT_FIELDS = ("messages", "prompt", "completion", "chosen", "rejected", "text", "tools")


class _TokensOnly(Dataset):
    """A tokenized set whose samples keep the text they came from (`{"input_ids", "labels", "messages"}`, what a
    `datasets` map leaves): the samples without the text fields, which no collate could batch."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return {k: v for k, v in self.dataset[index].items() if k not in TEXT_FIELDS}


def _tokens_only(dataset):
    first = text.first_sample(dataset)
    if isinstance(first, Mapping) and "input_ids" in first and any(k in first for k in TEXT_FIELDS):
        return _TokensOnly(dataset)
    return dataset


# --------------------------------------------------------------------------------------------------- one set


@dataclass
class Made:
    """How a set's tokens were made, for the start line: read from the cache, or tokenized by `workers` processes
    (`kept`: written to the cache; `why`: why not, or what was wrong with the file found)."""

    samples: int
    seconds: float
    folder: Path | None
    read: bool = False
    workers: int = 1
    kept: bool = False
    why: str | None = None

    def said(self, evaluation: bool) -> str:
        what = f"{self.samples:,} {'evaluation samples' if evaluation else 'samples'}"
        took = f"{self.seconds:.1f} s" if self.seconds >= 0.1 else f"{self.seconds * 1000:.0f} ms"
        if self.read:
            return f"{what} read from the token cache in {took}"
        processes = "this process" if self.workers == 1 else f"{self.workers} processes"
        said = f"{what} tokenized by {processes} in {took}"
        said += ", kept in the token cache" if self.kept else " (--token-cache off)" if self.folder is None else ""
        return said + (f" ({self.why})" if self.why else "")


def tokenized_once(dataset, tokenizer, kind: str, cfg: TrainConfig) -> tuple[Tokenized, Made]:
    """`dataset` (a map-style set of `kind`) tokenized: read from the token cache, else tokenized (in parallel) and
    kept there."""
    cut = (cfg.train_on_prompt, cfg.max_length, cfg.truncation)
    start, folder = time.perf_counter(), cache_folder(cfg.token_cache)
    made = Made(len(dataset), 0.0, folder)
    key, made.why = entry_key(dataset, tokenizer, kind, cut) if folder is not None else (None, None)
    path = folder / f"{key}.pt" if key is not None else None
    if path is not None and path.is_file():
        try:
            tokens = read_entry(path, key, kind)
        except ConfigError:  # the set was refused when it was tokenized: the same line
            raise
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, the set is tokenized again
            made.why = f"the file kept for it was unreadable, {type(e).__name__}: {first_line(e)}; tokenized again"
        else:
            made.read, made.seconds = True, time.perf_counter() - start
            return Tokenized(dataset, tokenizer, kind, *cut, tokens=tokens), made
    made.workers = workers_for(cfg.tokenize_workers, len(dataset))
    try:
        tokens = tokenize(dataset, tokenizer, kind, cut, made.workers)
    except ConfigError as e:
        if path is not None:
            write_entry(path, {"format": FORMAT, "key": key, "kind": kind, "refused": str(e)})
        raise
    if path is not None:
        failed = write_entry(path, {"format": FORMAT, "key": key, "kind": kind, "counts": list(tokens.counts),
                                    **{name: text.flat_tensor(getattr(tokens, name), dtype)
                                       for name, (_, dtype) in STORED.items()}})
        made.kept, made.why = failed is None, f"not kept: {failed}" if failed else made.why
    made.seconds = time.perf_counter() - start
    return Tokenized(dataset, tokenizer, kind, *cut, tokens=tokens), made


def cache_folder(option: str) -> Path | None:
    """--token-cache's folder (None: off)."""
    if option == "off":
        return None
    if option == "auto":
        return Path(os.environ.get("ACC_TRAINER_CACHE") or Path.home() / ".cache" / "acc_trainer" / "tokens")
    return Path(option).expanduser()


def workers_for(option: int | None, samples: int) -> int:
    """The processes that tokenize a set of `samples`: --tokenize-workers, else the CPU cores (up to 8, each with 256
    samples at least; with every process of a launch tokenizing at once, fit()'s, their share of the cores). One, in
    this process, where forking is not safe or not allowed."""
    if not sys.platform.startswith("linux") or multiprocessing.current_process().daemon:
        return 1
    if option is None:
        cores = len(os.sched_getaffinity(0))
        together = 1 if torch.distributed.is_available() and torch.distributed.is_initialized() else \
            int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        option = min(8, max(1, cores // together), max(1, samples // 256))
    return max(1, min(option, samples))


# ------------------------------------------------------------------------------------------------ the key


def entry_key(dataset, tokenizer, kind: str, cut: tuple) -> tuple[str | None, str | None]:
    """(the cache key of a set, None) or (None, why the set cannot be kept)."""
    train_on_prompt, max_length, truncation = cut
    data = data_digest(dataset)
    if data is None:
        return None, "not kept: its samples are not plain JSON, which keys the token cache"
    tokens = tokenizer_digest(tokenizer)
    if tokens is None:
        return None, f"not kept: the tokenizer ({type(tokenizer).__name__}) is not a transformers one"
    code = hashlib.blake2b(Path(text.__file__).read_bytes(), digest_size=16).hexdigest()
    options = [kind, train_on_prompt and kind in SFT, max_length,
               truncation if max_length is not None and kind != "prompt" else None]
    whole = json.dumps([FORMAT, code, _versions(), options, tokens, data])
    return hashlib.blake2b(whole.encode(), digest_size=16).hexdigest(), None


def data_digest(dataset) -> str | None:
    """A hash of a set's samples (None: they are not JSON): a `datasets.Dataset` read from files by its fingerprint
    (a hash of its files and of what was done to them), anything else by its samples' canonical JSON."""
    h = hashlib.blake2b(digest_size=16)
    try:
        if getattr(dataset, "cache_files", None) and isinstance(getattr(dataset, "_fingerprint", None), str):
            # datasets has no public accessor; its fingerprint is what its own cache is keyed by
            return f"datasets {dataset._fingerprint}"
        if hasattr(dataset, "iter") and hasattr(dataset, "column_names"):  # a datasets.Dataset held in memory
            parts = (json.dumps(batch, sort_keys=True) for batch in dataset.iter(batch_size=1024))
        elif isinstance(dataset, list):  # a slice at a time: json's C encoder, without one string of all of it
            parts = (json.dumps(dataset[i:i + 4096], sort_keys=True) for i in range(0, len(dataset), 4096))
        else:
            parts = (json.dumps(dataset[i], sort_keys=True) for i in range(len(dataset)))
        for part in parts:
            h.update(part.encode())
            h.update(b"\n")
    except (TypeError, ValueError):  # not JSON: a tensor, a key that is not a string
        return None
    return f"{len(dataset)} {h.hexdigest()}"


def tokenizer_digest(tokenizer) -> str | None:
    """A hash of what a tokenizer's tokens depend on (None: not a transformers tokenizer)."""
    if tokenizer is None:
        return "none"
    from transformers import PreTrainedTokenizerBase

    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        return None
    parts = {"class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
             "template": tokenizer.chat_template, "special": tokenizer.special_tokens_map,
             "added": {i: repr(t) for i, t in sorted(tokenizer.added_tokens_decoder.items())},
             "sides": [tokenizer.padding_side, tokenizer.truncation_side]}
    if getattr(tokenizer, "is_fast", False):
        backend = json.loads(tokenizer.backend_tokenizer.to_str())
        backend.pop("truncation", None), backend.pop("padding", None)  # set by each call, never by ours
        parts["backend"] = backend
    else:  # a slow one: its vocabulary files, and the settings it was made with that are not paths
        parts["files"] = {name: hashlib.blake2b(Path(path).read_bytes()).hexdigest()
                          for name in sorted(getattr(tokenizer, "vocab_files_names", {}))
                          if isinstance(path := getattr(tokenizer, name, None), str) and Path(path).is_file()}
        parts["vocab"] = sorted(tokenizer.get_vocab().items())
        parts["settings"] = {k: v for k, v in sorted(tokenizer.init_kwargs.items()) if isinstance(
            v, (str, int, float, bool, type(None))) and not any(w in k for w in ("file", "path", "name", "max_length"))}
    whole = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(whole.encode(), digest_size=16).hexdigest()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "tokenizers", "jinja2"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


# --------------------------------------------------------------------------------------------------- the file


def read_entry(path: Path, key: str, kind: str) -> Tokens:
    """The tokens kept in `path`; a ConfigError for a set refused when it was tokenized; any other error for a file
    that is not what its name says."""
    entry = torch.load(path, weights_only=True)
    if entry.get("format") != FORMAT or entry.get("key") != key or entry.get("kind") != kind:
        raise ValueError(f"it holds format {entry.get('format')} of a {entry.get('kind')} set with another key")
    if "refused" in entry:
        raise ConfigError(entry["refused"])
    tokens = Tokens(kind)
    tokens.counts = [int(c) for c in entry["counts"]]
    for name, (code, dtype) in STORED.items():
        tensor = entry[name]
        if tensor.dtype != dtype or tensor.dim() != 1:
            raise ValueError(f"its {name} is a {tensor.dtype} tensor of {tensor.dim()} dimensions")
        setattr(tokens, name, array(code, tensor.numpy().tobytes()))
    if sum(tokens.lengths) != len(tokens.ids) or (kind in SFT and len(tokens.mask) != len(tokens.ids)):
        raise ValueError("its lengths do not add up to its tokens")
    return tokens


def write_entry(path: Path, entry: dict) -> str | None:
    """`entry` saved as `path`, whole or not at all (None; else why not)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(entry, temporary)
        os.replace(temporary, path)
    except OSError as e:
        temporary.unlink(missing_ok=True)
        return f"{type(e).__name__}: {first_line(e)}"
    return None


# ------------------------------------------------------------------------------------------------ in parallel


def tokenize(dataset, tokenizer, kind: str, cut: tuple, workers: int) -> Tokens:
    """`dataset` tokenized by `workers` processes (1: in this one), the same `Tokens` as tokenize_range's over the
    whole set, and the same error: the one of the lowest sample that raises."""
    if workers == 1:
        return text.tokenize_range(dataset, tokenizer, kind, cut)
    n = len(dataset)
    size = max(1, min(1024, -(-n // (workers * 8))))  # a few chunks a process, in step with each other
    chunks = [(a, min(n, a + size)) for a in range(0, n, size)]
    context = multiprocessing.get_context("fork")
    pipes, children = {}, []
    try:
        for first in range(workers):
            reader, writer = context.Pipe(duplex=False)
            child = context.Process(target=_tokenize_chunks, daemon=True, name=f"acc_trainer-tokenize-{first}",
                                    args=(writer, dataset, tokenizer, kind, cut, chunks[first::workers], first, workers))
            child.start()
            writer.close()
            pipes[reader], children = child, children + [child]
        parts = _collected(pipes, len(chunks))
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
            child.join()
    for k, (a, b) in enumerate(chunks):  # the lowest failed chunk is the serial run's error
        outcome = parts.get(k)
        if isinstance(outcome, tuple):
            raise ConfigError(outcome[1]) if outcome[0] == "config" else RuntimeError(
                f"tokenizing samples {a} to {b - 1} failed in a tokenizing process: {outcome[1]}")
    whole = Tokens(kind)
    for k in range(len(chunks)):
        whole.extend(parts[k])
    return whole


def _collected(pipes: dict, chunks: int) -> dict:
    """Each chunk's Tokens (or its error, as (kind, line)) by its number, as the children send them; stops once a
    failed chunk has every chunk before it. A child that ends before its chunks are sent is an error."""
    parts: dict = {}
    while pipes:
        for reader in wait(list(pipes)):
            try:
                k, outcome = reader.recv()
            except EOFError:
                child = pipes.pop(reader)
                child.join()
                if child.exitcode:
                    raise RuntimeError(f"a tokenizing process ended with exit code {child.exitcode}") from None
                continue
            parts[k] = outcome
        failed = [k for k, outcome in parts.items() if isinstance(outcome, tuple)]
        if failed and all(k in parts for k in range(min(failed))):
            break
    if len(parts) < chunks and not any(isinstance(o, tuple) for o in parts.values()):
        raise RuntimeError(f"the tokenizing processes sent {len(parts)} of {chunks} chunks")
    return parts


def _tokenize_chunks(out, dataset, tokenizer, kind: str, cut: tuple, chunks: list, first: int, step: int) -> None:
    """A forked child: chunks first, first + step, ... of the set, each sent as (number, Tokens), or as (number,
    (kind, line)) for the first that raises, and then no more."""
    for k, (a, b) in zip(itertools.count(first, step), chunks):
        try:
            out.send((k, text.tokenize_range(dataset, tokenizer, kind, cut, a, b)))
        except ConfigError as e:
            out.send((k, ("config", str(e))))
            break
        except BaseException as e:  # noqa: BLE001 - a bug or a failing read: its traceback goes to the parent
            out.send((k, ("failed", f"{type(e).__name__}: {first_line(e)}\n{traceback.format_exc()}")))
            break
    out.close()
