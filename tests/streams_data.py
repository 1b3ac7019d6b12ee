"""Streams as users bring them, for tests/test_streams.py and tests/stream_probe.py: their own IterableDataset
(with and without a saved position) and Hugging Face `datasets` streams of parquet files the tests write.

Every stream gives the same 100 training samples of y = x @ w + noise (x in R^8), 31 evaluation samples,
in an order of its own; `parquet` splits them into three uneven shards (37, 45 and 18 rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import IterableDataset, TensorDataset

# The text kind is examples/text_classification.py's reviews, collate function and model.
EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

TRAIN, EVAL, SHARDS = 100, 31, (37, 45, 18)


def tensors(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ w + 0.1 * torch.randn(n, 1, generator=g)


class Numbers(IterableDataset):
    """A user's stream: the samples in an order reshuffled every epoch (`set_epoch`); `produced` counts the
    samples it has generated (in this process), so a test can tell whether a resume read them again."""

    produced = 0

    def __init__(self, n: int = TRAIN, seed: int = 1):
        self.x, self.y = tensors(n, seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        return torch.randperm(len(self.x), generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()

    def __iter__(self):
        for i in self.order():
            Numbers.produced += 1
            yield self.x[i], self.y[i]


class Positioned(Numbers):
    """The same stream, able to save and load its position (as a database cursor's offset would)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read, self.start = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "read": self.read}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["read"] if state["epoch"] == self.epoch else 0

    def __iter__(self):
        start, self.start = self.start, 0
        self.read = start
        for i in self.order()[start:]:
            Numbers.produced += 1
            self.read += 1
            yield self.x[i], self.y[i]


class ByProcess(Numbers):
    """A stream already split by process (every other sample by rank), as acc_trainer must refuse it."""

    def __iter__(self):
        from accelerate import PartialState

        state = PartialState()
        for i in self.order()[state.process_index::state.num_processes]:
            yield self.x[i], self.y[i]


class FailsOnce(Numbers):
    """An evaluation stream whose file vanishes at its `fail_at`-th pass (then it is back)."""

    def __init__(self, *args, fail_at: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes, self.fail_at = 0, fail_at

    def __iter__(self):
        self.passes += 1
        if self.passes == self.fail_at:
            raise FileNotFoundError(2, "No such file or directory", "eval-shard-0.bin")
        yield from super().__iter__()


class Texts(IterableDataset):
    """examples/text_classification.py's reviews (4 to 40 tokens each) as a stream, reshuffled every epoch."""

    def __init__(self, n: int, seed: int):
        from text_classification import Reviews

        self.reviews, self.epoch = Reviews(n, seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(len(self.reviews), generator=torch.Generator().manual_seed(100 + self.epoch)).tolist():
            yield self.reviews[i]


def write_parquet(folder: Path) -> dict[str, list[str]]:
    """The training samples as three parquet shards of uneven sizes and the evaluation samples as one file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    x, y = tensors(TRAIN, 1)
    files, start = [], 0
    for i, rows in enumerate(SHARDS):
        path = folder / f"train-{i:05d}.parquet"
        pq.write_table(pa.table({"x": x[start:start + rows].tolist(), "y": y[start:start + rows].tolist()}), path)
        files.append(str(path))
        start += rows
    ex, ey = tensors(EVAL, 2)
    pq.write_table(pa.table({"x": ex.tolist(), "y": ey.tolist()}), folder / "eval.parquet")
    return {"train": files, "eval": [str(folder / "eval.parquet")]}


def parquet_stream(files: list[str], shuffle: bool = False):
    """A Hugging Face `datasets` stream of local parquet files, as torch tensors."""
    import datasets
    from datasets import load_dataset

    # datasets waits this long for pyarrow's threads whenever a pass over a shuffled parquet stream ends or
    # is left (a workaround of its own): 5 s, per pass, on files of 100 rows. Not in these tests.
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0

    stream = load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")
    return stream.shuffle(seed=3, buffer_size=16) if shuffle else stream


def pairs(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Collates a `datasets` stream's dict samples into (x, y)."""
    return torch.stack([s["x"] for s in samples]), torch.stack([s["y"] for s in samples])


def in_memory(n: int = TRAIN, seed: int = 1) -> TensorDataset:
    return TensorDataset(*tensors(n, seed))


class OwnLoss(torch.nn.Module):
    """A model that takes its targets and returns its own loss, as a Hugging Face model given `labels` does."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(logits, labels), "logits": logits}


def as_dict(samples: list) -> dict:
    """Collates (x, y) samples into the dict batch OwnLoss takes (its targets under "labels")."""
    return {"x": torch.stack([x for x, _ in samples]), "labels": torch.stack([y for _, y in samples])}


def model(kind: str = "numbers") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "text":
        from text_classification import BagOfEmbeddings

        return BagOfEmbeddings()
    if kind == "own_loss":
        return OwnLoss()
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def collate(kind: str):
    """The collate function a kind's samples need (None: the default)."""
    if kind == "text":
        from text_classification import pad

        return pad
    if kind == "own_loss":
        return as_dict
    return pairs if kind.startswith("parquet") else None


def datasets(kind: str, folder: Path | None = None) -> tuple:
    """(train, eval) of a kind: numbers, positioned, own_loss, map, by_process, text, or parquet, parquet_shuffled (of
    the files write_parquet wrote into `folder`)."""
    if kind in ("numbers", "positioned", "own_loss"):  # own_loss: the user's stream, for a model with its own loss
        cls = Positioned if kind == "positioned" else Numbers
        return cls(), cls(EVAL, 2)
    if kind == "map":
        return in_memory(), in_memory(EVAL, 2)
    if kind == "by_process":
        return ByProcess(), None
    if kind == "text":
        return Texts(TRAIN, 0), Texts(EVAL, 1)
    train = sorted(str(p) for p in Path(folder).glob("train-*.parquet"))
    return parquet_stream(train, shuffle=kind == "parquet_shuffled"), parquet_stream([str(Path(folder) / "eval.parquet")])


# --dataset streams_data:factory for the command line (a user's factory returns (train, eval)).
def factory(kind: str = "numbers", folder: str = "parquet", samples: int = TRAIN):
    if kind == "short":
        return Numbers(samples), None
    return datasets(kind, Path(folder))
