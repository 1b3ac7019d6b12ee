"""Samples that cannot be read, named and agreed on by every process: a file that does not open (a truncated image,
a vanished file) and a stream whose read fails.

A map-style set read from files goes through `Guarded`, which hands the batch a stand-in and the sample's index;
the training steps and evaluation then agree on the indices over every process (`unreadable_everywhere`) and stop
naming the files (`sample_name`), or skip the step (--skip-bad-samples). `acc-trainer check-data` opens every sample
once (`unreadable_samples`). A stream's loader agrees on its read faults itself (streams.py); `stream_faults` turns
one into the run's stop.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import Dataset

from ..config import first_line
from ..stopping import TrainingStopped
from .streams import StreamUnreadable


class Guarded(Dataset):
    """A dataset read from files, whose samples may not open (a truncated image, a vanished file).

    Yields `(sample, -1)`, or for a sample that raises OSError `(stand-in, index)`: the last good
    sample takes its place, so that the batch still forms (and every process still makes its step,
    as DDP needs), and the index travels with the batch, through DataLoader workers too. The loop then
    stops with a line naming the file, or skips the step (--skip-bad-samples). Other exceptions are
    bugs in the dataset's code and pass through.
    """

    def __init__(self, base: Dataset):
        self.base, self._last_good = base, None

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        try:
            sample = self.base[index]
        except OSError:
            return self._stand_in(index), index
        self._last_good = sample
        return sample, -1

    def _stand_in(self, index: int):
        for other in range(index + 1, index + 1 + len(self.base)):
            if self._last_good is not None:
                return self._last_good
            try:
                self._last_good = self.base[other % len(self.base)]
            except OSError:
                continue
        raise OSError(f"no sample of {type(self.base).__name__} can be read")

    @staticmethod
    def collate(items: list, collate=None) -> tuple:
        from torch.utils.data import default_collate

        # The indices as plain ints: moved to no device, read without waiting for one.
        return (collate or default_collate)([sample for sample, _ in items]), [index for _, index in items]


def sample_name(dataset: Dataset, index: int) -> str:
    """`path/to/file (OSError: why)` for ImageFolder-like datasets, else `sample N (...)`."""
    samples = getattr(dataset, "samples", None)
    name = str(samples[index][0]) if isinstance(samples, list) and index < len(samples) else f"sample {index}"
    try:
        dataset[index]
    except OSError as e:
        return f"{name} ({type(e).__name__}: {first_line(e)})"
    return name


def unreadable_samples(dataset: Dataset, collate=None) -> list[str]:
    """Opens every sample once: the names of those that cannot be read (or, with a collate function,
    that it cannot batch, each alone)."""
    bad = []
    for index in range(len(dataset)):
        try:
            sample = dataset[index]
        except OSError:
            bad.append(sample_name(dataset, index))
            continue
        if collate is not None:
            try:
                collate([sample])
            except Exception as e:  # noqa: BLE001 - named in the list, whatever the collate function raised
                bad.append(f"sample {index} (the collate function raised {type(e).__name__}: {first_line(e)})")
    return bad


def unreadable_everywhere(accelerator: Accelerator, local: list[int]) -> list[int]:
    """The indices of unreadable samples on any process, the same list on all (one tiny all-reduce;
    the indices themselves are gathered only when there are some)."""
    if accelerator.num_processes == 1:
        return sorted(set(local))
    if accelerator.reduce(torch.tensor(len(local), device=accelerator.device), "sum").item() == 0:
        return []
    return sorted({i for part in gather_object([local]) for i in part})


@contextmanager
def stream_faults(stop: Callable[[StreamUnreadable], str]):
    """A stream that cannot be read stops every process at the same batch (its loader agrees on it) with one
    line: `stop(error)` does what must be done first (the training run saves a checkpoint) and says it."""
    try:
        yield
    except StreamUnreadable as e:
        raise TrainingStopped(stop(e), code=1) from None
