"""What kind of data a run has, decided once where its data is built (`settle`) and read by everything after it.

A set is a stream or map-style, its tensors are in memory or its samples are read one at a time (from files that may
fail to open), it is served a whole batch per gather (the batched path) or one sample at a time through a
DataLoader's collate (the per-sample path), and the run's sets are packed or not. The loaders, the checks at start,
the training steps, evaluation and `acc-trainer check-data` read `Data.kind` instead of asking the datasets again.
"""

from __future__ import annotations

from dataclasses import replace

from torch.utils.data import IterableDataset, TensorDataset

from .datasets import Data, DataKind, InMemory, PerSample, SetKind
from .packing import is_packed


def set_kind(dataset, pipeline: str = "batched", collate=None) -> SetKind:
    """How `dataset` is read, for the run's --data-pipeline and collate function (None: the default collate)."""
    stream = is_stream(dataset)
    in_memory = type(dataset) in (TensorDataset, InMemory)
    base = dataset.base if isinstance(dataset, PerSample) else dataset
    return SetKind(stream=stream, in_memory=in_memory, batched=in_memory and pipeline == "batched" and collate is None,
                   guarded=not stream and not isinstance(base, TensorDataset),
                   length=length(dataset) if stream else len(dataset))


def settle(data: Data, pipeline: str = "batched", collate=None) -> Data:
    """`data` with its kind decided, for the run's --data-pipeline and collate function (None: the default collate)."""
    kind = DataKind(set_kind(data.train, pipeline, collate),
                    set_kind(data.eval, pipeline, collate) if data.eval is not None else None,
                    is_packed(data.train))
    return replace(data, kind=kind)


def is_stream(dataset) -> bool:
    """An iterable dataset: torch's IterableDataset (Hugging Face `datasets` streams are), or any object that
    can be iterated but not indexed. Asked where the data is built (here and in user_data.py); the run reads
    `Data.kind` after that."""
    if dataset is None:
        return False
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))


def length(dataset) -> int | None:
    """The number of samples a stream says it has (`__len__`), else None (learnt in its first epoch)."""
    try:
        return int(len(dataset))
    except (TypeError, NotImplementedError, AttributeError):
        return None
