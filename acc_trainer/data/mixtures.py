"""Mixtures: several datasets sampled with weights, as one training set (docs/data.md#mixtures).

A run names them with `--dataset NAME=WEIGHT` once for each set (a weight left out is 1: `--rewards`' syntax), a
YAML list (`dataset: [chat.jsonl=0.7, code.jsonl=0.3]`, or of mappings `[{chat.jsonl: 0.7}, ...]`, or one mapping),
or `fit(model, [(chat, 0.7), (code, 0.3)])`; weights are positive and need not sum to 1 (they are normalised). Each
set is built, checked and tokenized as it would be alone (workload/components.py), then mixed here; the sets must be
of one kind (all map-style or all streams; all of one text kind, or none text).

The rule, the same on every process and at every resume because it reads nothing but (--seed, position):

- Which set a position holds: the position's uniform number u(seed, epoch, position), augment.py's counter-based
  hash (salted, so that it is not the augmentation's own number of the same sample), falls into one set's stretch
  of [0, 1), each stretch as long as the set's share of the weights. Each position is an independent draw, so the
  measured shares differ from the weights by sampling noise (about 0.5 % at 8,000 samples for 0.7/0.3); the start
  line says the measured ones.
- Map-style sets: a `Mixture` of `sum of the sets' sizes` positions (the length a user would expect: as many samples
  as the sets hold together; `Mixture(..., length=N)` from Python for another), drawn once at build (epoch 0). The
  k-th position drawn for a set holds the set's sample `perm[k % size]`, `perm` a permutation of the set from a
  torch.Generator seeded with --seed (so a set drawn more often than it holds is cycled, each sample as often as any
  other, to within one; a set drawn less often gives the same subset every epoch: raise its weight, or use its own
  run, to see all of it). The loader's sampler then shuffles and shards the mixture as any map-style set, so 1 or N
  processes, accumulation and resume see the same samples in the same order. Sets of plain tensors (TensorDataset)
  are mixed into one TensorDataset, which keeps the batched path (data in memory, on the device).
- Streams: a `MixedStream` draws position p's set by the same rule with the epoch in the key (another interleaving
  each epoch), and takes that stream's next sample; the epoch ends when a drawn stream ends. A resume that skips
  the epoch's first samples (streams.py) replays the same draws, so it is exact. It has no length (the number of
  samples of an epoch is learnt in the first one, as any stream without `__len__`).
- Evaluation: the sets' evaluation splits concatenated, each sample once (no weighting: an evaluation counts every
  sample of the held-out sets once); None when no set has one. `fit()` takes `eval_data` as one set.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from numbers import Real
from typing import Any, NamedTuple

import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, TensorDataset

from ..config import ConfigError, dataset_sets
from .augment import uniforms
from .kinds import is_stream
from .streams import start_epoch

SALT = 0x4D495854  # "MIXT": the set draws apart from augmentation's numbers of the same (seed, epoch, index)
CHUNK = 4096  # positions drawn at a time by a stream


class Part(NamedTuple):
    """One set of a mixture: its name, training and evaluation splits (eval may be None) and weight."""

    name: str
    train: Any
    eval: Any
    weight: float


def drawn(seed: int, epoch: int, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The set each position holds: where its uniform number falls among the weights' cumulative shares."""
    bounds = (weights / weights.sum()).cumsum(0)
    u = uniforms(seed ^ SALT, epoch, positions, 1)[:, 0]
    return torch.searchsorted(bounds, u, right=True).clamp_(max=len(weights) - 1)


class Mixture(Dataset):
    """Map-style sets mixed with `weights` (see the module's docstring): position p holds sample `index[p]` of set
    `which[p]`. `counts` is how many positions each set holds; `kind` the sets' text kind (data/text.py), or None."""

    def __init__(self, sets, weights, seed: int = 0, names=None, length: int | None = None):
        self.sets, self.names = list(sets), list(names or [f"set {i}" for i in range(len(sets))])
        self.weights = _weights(weights, self.names)
        sizes = [len(s) for s in self.sets]
        empty = [n for n, size in zip(self.names, sizes) if not size]
        if empty:
            raise ConfigError(f"mixture: {empty[0]} holds no sample")
        self.sizes = sizes
        total = sum(sizes) if length is None else length
        self.which = drawn(seed, 0, torch.arange(total), self.weights)
        self.index = torch.empty(total, dtype=torch.long)
        generator = torch.Generator().manual_seed(seed)
        for i, size in enumerate(sizes):
            at = (self.which == i).nonzero().squeeze(1)
            self.index[at] = torch.randperm(size, generator=generator)[torch.arange(len(at)) % size]
        self.counts = torch.bincount(self.which, minlength=len(sizes)).tolist()
        self.kind = _kind(self.sets[0])

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, position: int):
        if not -len(self) <= position < len(self):
            raise IndexError(f"position {position} of a mixture of {len(self)}")
        position %= len(self)
        return self.sets[int(self.which[position])][int(self.index[position])]

    def shares(self) -> str:
        """The start line's: each set's measured share and count, and how often a set drawn beyond its size is cycled."""
        said = []
        for i, (name, count, size) in enumerate(zip(self.names, self.counts, self.sizes)):
            passes = f", {count / size:.2f} passes over its {size:,}" if count > size else ""
            said.append(f"{name} {count / max(len(self), 1):.1%} ({count:,}{' samples' if i == 0 else ''}{passes})")
        weights = ", ".join(f"{w:g}" for w in self.weights.tolist())
        return f"mixture: {', '.join(said)} of {len(self):,}, drawn with weights {weights} from --seed"


class MixedStream(IterableDataset):
    """Streams mixed with `weights`: position p of an epoch takes the next sample of the stream `drawn` for
    (seed, epoch, p); the epoch ends when a drawn stream ends."""

    def __init__(self, streams, weights, seed: int = 0, names=None):
        self.streams, self.names = list(streams), list(names or [f"stream {i}" for i in range(len(streams))])
        self.weights, self.seed, self.epoch = _weights(weights, self.names), seed, 0
        self.kind = _kind(self.streams[0])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for stream in self.streams:
            start_epoch(stream, epoch)

    def __iter__(self):
        samples = [iter(s) for s in self.streams]
        for start in itertools.count(0, CHUNK):
            for i in drawn(self.seed, self.epoch, torch.arange(start, start + CHUNK), self.weights).tolist():
                sample = next(samples[i], _END)
                if sample is _END:
                    return
                yield sample


class Chained(IterableDataset):
    """Evaluation streams one after the other, each sample once."""

    def __init__(self, sets):
        self.sets = list(sets)

    def __iter__(self):
        for dataset in self.sets:
            yield from dataset if is_stream(dataset) else (dataset[i] for i in range(len(dataset)))


_END = object()


def mix(parts: list[Part], seed: int) -> tuple[Any, Any, str]:
    """(train, eval, the start line's note) of the mixed `parts`, each already built and tokenized as alone."""
    names = unique([p.name for p in parts])
    trains, weights = [p.train for p in parts], [p.weight for p in parts]
    streams = [is_stream(t) for t in trains]
    if any(streams) and not all(streams):
        other, what = streams.index(not streams[0]), ("map-style", "a stream")
        raise ConfigError(f"mixture: {names[0]} is {what[streams[0]]} and {names[other]} {what[streams[other]]}: a "
                          "mixture's sets are all streams or all map-style")
    kinds = [_kind(t) for t in trains]
    if len(set(kinds)) > 1:
        other = next(i for i, k in enumerate(kinds) if k != kinds[0])
        raise ConfigError(f"mixture: {names[0]} holds {kinds[0] or 'samples that are not text'} and {names[other]} "
                          f"{kinds[other] or 'samples that are not text'}: a mixture's sets are of one kind")
    if all(streams):
        shares = ", ".join(f"{n} {w:.1%}" for n, w in zip(names, (torch.tensor(weights) / sum(weights)).tolist()))
        train, note = MixedStream(trains, weights, seed, names), f"mixture of streams: {shares} of the samples, drawn " \
            "position by position from --seed (an epoch ends when a drawn stream ends)"
    else:
        mixture = Mixture(trains, weights, seed, names)
        train, note = _tensors(trains, mixture.which, mixture.index) or mixture, mixture.shares()
    return train, _joined([p.eval for p in parts if p.eval is not None]), note


def is_mixture(data) -> bool:
    """Whether fit()'s training data is a list of (dataset, weight) pairs rather than a list of samples."""
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], Real) and not isinstance(p[1], bool) and _a_set(p[0])
        for p in data)


def label(dataset: str | list) -> str:
    """How a run names its data (the run folder, the start line): --dataset's name, or a mixture's sets' last names
    joined by '+' (runs/<time>-<model>-chat.jsonl_code.jsonl)."""
    if isinstance(dataset, str):
        return dataset
    return "+".join(name.rstrip("/").rpartition("/")[2].rpartition(":")[2] for name, _ in dataset_sets(dataset))


def _a_set(obj) -> bool:
    """A dataset rather than a sample's inputs: a torch Dataset, a stream, or a collection of samples (not a tensor,
    an array, a text or a list of numbers)."""
    if isinstance(obj, Dataset):
        return True
    if isinstance(obj, (str, bytes, Mapping)) or (hasattr(obj, "shape") and hasattr(obj, "dtype")):
        return False
    if isinstance(obj, (list, tuple)):
        return len(obj) > 0 and isinstance(obj[0], (Mapping, tuple, list))
    return (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")) or hasattr(obj, "__iter__")


def _joined(evals: list):
    """The evaluation splits one after the other, each sample once; None when no set has one."""
    if len(evals) < 2:
        return evals[0] if evals else None
    if any(map(is_stream, evals)):
        return Chained(evals)
    which = torch.cat([torch.full((len(e),), i, dtype=torch.long) for i, e in enumerate(evals)])
    return _tensors(evals, which, torch.cat([torch.arange(len(e)) for e in evals])) or ConcatDataset(evals)


def _weights(weights, names: list[str]) -> torch.Tensor:
    weights = torch.as_tensor([float(w) for w in weights], dtype=torch.float64)
    if len(weights) != len(names) or not len(weights):
        raise ConfigError(f"mixture: {len(weights)} weights for {len(names)} sets")
    bad = next((i for i, w in enumerate(weights.tolist()) if not 0 < w < float("inf")), None)
    if bad is not None:
        raise ConfigError(f"mixture: the weight of {names[bad]} is {weights[bad].item():g}; weights are positive numbers")
    return weights


def _kind(dataset) -> str | None:
    """The text kind of a tokenized set or stream (data/text.py's `kind`), else None."""
    kind = getattr(dataset, "kind", None)
    return kind if isinstance(kind, str) else None


def unique(names: list[str]) -> list[str]:
    """The sets' names, those given twice told apart by their place (`Samples (1)`, `Samples (2)`)."""
    return [f"{n} ({i + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]


def _tensors(sets: list, which: torch.Tensor, index: torch.Tensor) -> TensorDataset | None:
    """Plain TensorDatasets gathered into one at (set, sample) = (which, index), so that they stay in memory on the
    batched path; None for any other sets (or tensors of different shapes or dtypes)."""
    if not all(type(s) is TensorDataset for s in sets) or len({len(s.tensors) for s in sets}) != 1:
        return None
    columns = list(zip(*(s.tensors for s in sets)))
    if any(len({(tuple(t.shape[1:]), t.dtype) for t in column}) != 1 for column in columns):
        return None
    at = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)[which] + index
    return TensorDataset(*(torch.cat(column)[at] for column in columns))
