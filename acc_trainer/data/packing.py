"""Packing: documents of tokens as blocks of one fixed length, each document kept apart (`--pack LENGTH`,
`pack(dataset, length)`).

A document is a 1-D integer tensor, array or list of token ids, or a dict with `input_ids` (and, optionally,
`labels` and an `attention_mask`, whose zeros are padding and left out). The blocks are planned once from
every document's length, the same way on every process: the documents are placed best-fit decreasing (each,
longest first, into the block with the least room that holds it), so that a document is never cut and the
blocks carry little padding; a document longer than a block is first cut into pieces of the block's length,
each then a document of its own. The packed set is map-style, its blocks in the order of their first
documents: samplers, `--resume`, evaluation and `evaluate` take it as any other. A stream of documents (an
iterable dataset) is packed as it is read (`PackedStream`): the same plan, made for each window of `WINDOW`
documents in the stream's order.

A block is a dict of three tensors of `length` tokens: `input_ids`; `position_ids`, restarting at 0 where each
document (or piece) starts; `labels`, the document's labels (its tokens when it has none) with -100 at each
document's first token, so that no token is trained to predict the next document's first (a causal language
model's labels are shifted inside it), and on the padding at the block's end (token `pad_id`, its positions
counting from 0 as a document of its own). There is no `attention_mask`: transformers' models then read the
documents' boundaries from where the position ids restart and attend within each document only
(transformers' masking_utils.find_packed_sequence_indices) - not every architecture does (OPT, Falcon, Bloom
and MPT attend across), so the first-sample check proves it on the run's own model before training
(workload/first_batch.py: `check_attention`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping
from itertools import islice
from numbers import Integral
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from ..config import ConfigError
from .datasets import IGNORE_INDEX

KEYS = ("input_ids", "labels", "attention_mask")  # what a document given as a dict may hold
WINDOW = 1000  # the documents of a stream planned together (PackedStream): its best-fit decreasing has room to
# choose, and a window of documents of a few thousand tokens is a few tens of MB


class Packed(Dataset):
    """`documents` as blocks of `length` tokens (see the module's docstring)."""

    def __init__(self, documents, length: int, name: str | None = None, pad_id: int = 0):
        self.documents, self.length, self.pad_id = documents, length, pad_id
        self.name = name or type(documents).__name__
        sizes = [len(self._read(i)[0]) for i in range(len(documents))]
        blocks = _plan(sizes, length)
        # Flat tensors, not a list of tuples per block: a few bytes a document however many there are.
        self._first = torch.tensor([0] + [len(b) for b in blocks]).cumsum(0)
        self._pieces = torch.tensor([piece for block in blocks for piece in block], dtype=torch.long).reshape(-1, 3)
        self.tokens = sum(sizes)  # the real tokens of every block together

    def __len__(self) -> int:
        return len(self._first) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        index %= len(self)
        pieces = self._pieces[self._first[index]:self._first[index + 1]].tolist()
        return _block(pieces, self._read, self.length, self.pad_id)

    def _read(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _document(self.documents[index], index, self.name)


class PackedStream(IterableDataset):
    """A stream of documents as blocks of `length` tokens, packed as it is read: the documents are taken `window` at
    a time, in the stream's order, and each window is planned as `Packed` plans a whole set (best-fit decreasing; a
    document longer than a block cut into pieces first), its blocks handed out in the order of their first documents
    before the next window is read. So a document is never cut by a window's end, the plan is the same on every
    process (each reads the whole stream: streams.py) and in every pass, and a stream of at most `window` documents
    gives the blocks `pack` gives the same documents as a map-style set. It offers no saved position (a window is
    read ahead of the blocks handed out): a resumed run reads the epoch again and skips the blocks consumed
    (streams.py), which is exact because the plan is. No length either: a stream's is learnt in its first epoch."""

    def __init__(self, documents, length: int, name: str | None = None, pad_id: int = 0, window: int = WINDOW):
        self.documents, self.length, self.pad_id, self.window = documents, length, pad_id, window
        self.name = name or type(documents).__name__

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.documents, "set_epoch", None)):  # a stream that reshuffles per epoch
            self.documents.set_epoch(epoch)

    def __iter__(self):
        documents, read = iter(self.documents), 0
        while True:
            window = [_document(d, read + i, self.name) for i, d in enumerate(islice(documents, self.window))]
            if not window:
                return
            read += len(window)
            for pieces in _plan([len(ids) for ids, _ in window], self.length):
                yield _block(pieces, window.__getitem__, self.length, self.pad_id)


def _block(pieces: list, read, length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One block from its pieces (document, start, stop); `read(document)` gives a document's (token ids, labels)."""
    ids = torch.full((length,), pad_id, dtype=torch.long)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(length, dtype=torch.long)
    at = 0
    for doc, start, stop in pieces:
        tokens, targets = read(doc)
        n = stop - start
        ids[at:at + n] = tokens[start:stop]
        labels[at + 1:at + n] = targets[start + 1:stop]  # the first token is never a target
        positions[at:at + n] = torch.arange(n)
        at += n
    positions[at:] = torch.arange(length - at)  # the padding: a document of its own, never trained
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _document(sample, index: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Document `index` as (token ids, labels), 1-D; anything that is not a document is one line."""
    if isinstance(sample, Mapping) and "input_ids" in sample:
        extra = [k for k in sample if k not in KEYS]
        if extra:
            raise ConfigError(f"--pack: the samples of {name} hold {', '.join(map(repr, extra))} beside "
                              f"input_ids; packing keeps {', '.join(KEYS)} only: drop the others (Hugging Face "
                              "datasets: remove_columns)" + (" (are they packed already?)" if "position_ids" in
                                                             extra else ""))
        ids = _tokens(sample["input_ids"])
        labels = _tokens(sample["labels"]) if sample.get("labels") is not None else ids
        mask = _tokens(sample["attention_mask"]) if sample.get("attention_mask") is not None else None
        if ids is not None and labels is not None and len(labels) == len(ids) and (mask is None or len(mask) == len(ids)):
            keep = mask != 0 if mask is not None else slice(None)
            return ids[keep], labels[keep]
    else:
        ids = _tokens(sample)
        if ids is not None:
            return ids, ids
    raise ConfigError(f"--pack: sample {index} of {name} is {_describe(sample)}, not a document of tokens "
                      "(packing without token inputs): give 1-D integer tensors or lists of token ids, or dicts "
                      "of input_ids (with labels and an attention_mask of the same length, if any)")


def _tokens(value) -> torch.Tensor | None:
    """A 1-D integer sequence as a LongTensor, else None."""
    if isinstance(value, (list, tuple)) and not all(isinstance(v, Integral) and not isinstance(v, bool) for v in value):
        return None
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if tensor.dim() != 1 or tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        return None
    return tensor.long()


def _plan(sizes: list[int], length: int) -> list[list[tuple[int, int, int]]]:
    """The blocks, each a list of pieces (document, start, stop): best-fit decreasing, a document longer
    than `length` cut into pieces of `length` first. Deterministic: ties go by the documents' order."""
    items = sorted(((min(length, size - start), doc, start) for doc, size in enumerate(sizes)
                    for start in range(0, size, length)), key=lambda item: (-item[0], item[1], item[2]))
    blocks: list[list[tuple[int, int, int]]] = []
    rooms: list[int] = []  # the distinct rooms left in the open blocks, sorted (at most length of them)
    by_room: dict[int, list[int]] = {}  # room -> the blocks with that much room
    for size, doc, start in items:
        i = bisect_left(rooms, size)
        if i < len(rooms):  # the block with the least room that holds it
            room = rooms[i]
            block = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], rooms[i]
        else:
            room, block = length, len(blocks)
            blocks.append([])
        blocks[block].append((doc, start, start + size))
        room -= size
        if room:
            if room not in by_room:
                insort(rooms, room)
                by_room[room] = []
            by_room[room].append(block)
    for block in blocks:
        block.sort()  # within a block, in the documents' order
    return sorted(blocks)


def pack(dataset, length: int, name: str | None = None, pad_id: int = 0, window: int = WINDOW) -> Packed | PackedStream:
    """`dataset`'s documents as blocks of `length` tokens (a `Packed` dataset; a stream as a `PackedStream`, planned
    `window` documents at a time); what `--pack LENGTH` does to the training and evaluation sets. A packed set given
    again is kept as it is (with the same length)."""
    name = name or type(dataset).__name__
    if isinstance(dataset, (Packed, PackedStream)):
        if dataset.length != length:
            raise ConfigError(f"--pack {length}: {name} is packed already, in blocks of {dataset.length}")
        return dataset
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        if isinstance(dataset, IterableDataset) or hasattr(dataset, "__iter__"):  # a stream (kinds.is_stream)
            return PackedStream(dataset, length, name, pad_id, window)
        raise ConfigError(f"--pack: {name} is a {type(dataset).__name__}, not a map-style dataset of documents")
    return Packed(dataset, length, name, pad_id)


def is_packed(dataset) -> bool:
    """Whether `dataset` is blocks of documents: a packed set or a packed stream."""
    return isinstance(dataset, (Packed, PackedStream))


def pack_sets(train, eval_, length: int | None, name: str) -> tuple[Any, Any]:
    """(train, eval) packed with `length` (evaluation the same way as training, so that its loss is the
    token mean over the same kind of blocks); as they are when `length` is None."""
    if length is None:
        return train, eval_
    return pack(train, length, name), pack(eval_, length, f"{name} (evaluation)") if eval_ is not None else None


def _describe(obj) -> str:
    """What a sample is, for the one line that refuses it: `a tuple (tensor [3, 32, 32] float32, int)`."""
    if isinstance(obj, torch.Tensor):
        return f"a tensor {list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if isinstance(obj, Mapping):
        return "a dict {" + ", ".join(f"{k}: {_describe(v).removeprefix('a ')}" for k, v in obj.items()) + "}"
    if isinstance(obj, (tuple, list)) and len(obj) <= 4:
        return f"a {type(obj).__name__} (" + ", ".join(_describe(v).removeprefix("a ") for v in obj) + ")"
    return f"a {type(obj).__name__}" + (f" of {len(obj)} items" if isinstance(obj, (tuple, list)) else "")
