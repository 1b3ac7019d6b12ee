"""Streams: iterable datasets (a user's `IterableDataset`, a Hugging Face `datasets` stream, a database
query run by `__iter__`) read in their own order, with the same guarantees as datasets held in memory. Each
`iter()` starts the stream anew (a one-shot iterator is refused: user_data.data_from).

How a stream is shared: every process reads the whole stream, cuts it into global batches of
`--batch-size` samples (one per optimizer step) and collates only its own share of each micro-batch, the
same slice Accelerate gives it of a map-style batch (`split_batches=True`). So a step trains on the same
global batch on any number of processes, no sample is used twice in a step, and every process makes as
many steps whatever the shards (none of them ends early: they read the same stream). The last samples
of an epoch that do not fill a global batch are left out, as the map-style loader leaves them out.
A stream that gives each process other samples (split by process already) is refused at start.

Accelerate shards an iterable dataset itself (`IterableDatasetShard`, or `dispatch_batches`, which
reads on one process and broadcasts tensors only), but cannot resume one without reading it again from
its start, and pads the last evaluation batch with repeated samples that it cannot leave out of a stream
of unknown length. So a stream's loader is this module's, and passes through `prepare` untouched.

Position: after every step the loader records `{"epoch", "samples", "state"}` (samples read in the epoch,
and the stream's `state_dict()` where it can save its position). A resumed run loads that state, or,
for a stream that cannot (or a `datasets` stream with a shuffle buffer, whose saved state leaves the
buffer's samples out), reads the stream again from the epoch's start and skips what was consumed: the
time either takes is reported. The position counts samples of the whole stream, not of a process,
so a checkpoint continues on another number of processes.

Read-ahead: a thread of each process (the default) or one DataLoader worker process (`--num-workers 1`; more
could not keep one stream's order) reads the next `AHEAD` steps while the current one trains; the training
thread collates (a collate function's random draws then come in the run's order). A stream read in a
worker draws its random numbers, and keeps its counters, there.
Faults: a stream that cannot be read (OSError, pyarrow's errors for a damaged file) stops every process at
the same step, naming the file where the error says it; an empty stream, or one shorter than one global
batch, is one line at start. Each step begins with one all-reduce of two numbers (every process has
a step; none failed), as the map-style loader's unreadable-sample check does.
"""

from __future__ import annotations

import copy
import json
import logging
import multiprocessing
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from .. import patches
from ..config import ConfigError, first_line
from .datasets import Uncollated

AHEAD = 2  # steps read ahead of the one training
LET_GO = 5.0  # seconds a stream's reader thread gets to see that the run stopped reading, before it is left behind


def saves_position(dataset) -> bool:
    """Whether a resumed run can load the stream's saved position instead of reading it again: it has
    `state_dict()` and `load_state_dict()`, and the state is the whole position. A `datasets` stream with a
    shuffle buffer is not (its documentation: the buffer's samples are lost on resume), found in its chain of
    example iterables (the narrowest place that says so)."""
    if not (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))):
        return False
    parts = [getattr(dataset, "_ex_iterable", None)]
    while parts:  # through the chain, and the sources of interleaved or concatenated streams
        part = parts.pop()
        if part is None:
            continue
        if type(part).__name__ == "BufferShuffledExamplesIterable":
            return False
        parts += [getattr(part, "ex_iterable", None), *(getattr(part, "ex_iterables", None) or [])]
    return True


def start_epoch(dataset, epoch: int) -> None:
    """Streams that shuffle per epoch (`datasets`' shuffle(seed, buffer_size)) are told the epoch."""
    if callable(getattr(dataset, "set_epoch", None)):
        dataset.set_epoch(epoch)


def first(dataset, n: int, name: str = "the stream", heads=None) -> list:
    """The first `n` samples of epoch 0 (fewer when the stream is shorter); with `heads` (datasets.Heads, the run's),
    read once per run: every check at start looks at them, and opening a stream can cost (`datasets` waits 5 s
    for pyarrow's threads whenever a shuffled parquet stream is left before its end)."""
    held = heads.get(dataset, n) if heads is not None else None
    if held is not None:
        return held
    start_epoch(dataset, 0)
    with naming_files() as named:
        try:
            samples = list(islice(iter(dataset), max(n, 16)))
        except Exception as e:
            if not is_read_error(e):
                raise  # a bug in the stream's code: its traceback is the user's
            raise ConfigError(f"{name} cannot be read at its start ({describe_error(e, named.files)})") from None
    if heads is not None:
        heads.keep(dataset, samples, len(samples) < max(n, 16))
    return samples[:n]


def read_through(dataset, collate: Callable | None = None) -> tuple[int, list[str]]:
    """`acc-trainer check-data` on a stream: reads epoch 0 to its end (each sample through `collate` alone, when
    given). Returns the samples read and what went wrong: the read error that ended it (naming the file where
    it can), or samples the collate function cannot batch."""
    count, problems = 0, []
    start_epoch(dataset, 0)
    with naming_files() as named:
        try:
            for sample in dataset:
                count += 1
                if collate is not None:
                    try:
                        collate([sample])
                    except Exception as e:  # noqa: BLE001 - named in the list, whatever the collate function raised
                        problems.append(f"sample {count - 1} (the collate function raised {type(e).__name__}: "
                                        f"{first_line(e)})")
        except Exception as e:
            if not is_read_error(e):
                raise  # a bug in the stream's code: its traceback is the user's
            problems.append(f"after sample {count:,}: {describe_error(e, named.files)}")
    return count, problems


def is_read_error(error: BaseException) -> bool:
    """Data that cannot be read, not a bug in the stream's code: OSError, or pyarrow's errors (a damaged
    parquet file is ArrowInvalid)."""
    return isinstance(error, OSError) or type(error).__module__.startswith("pyarrow")


def fingerprint(samples: list) -> list[float]:
    """Two numbers that differ when the samples do (their sum, and a sum weighted by position)."""
    flat = [torch.as_tensor(v).double().flatten() for v in _leaves(samples)]
    if not flat:
        return [0.0, 0.0]
    values = torch.cat(flat)
    return [float(values.sum()), float((values * torch.arange(1, len(values) + 1, dtype=torch.float64)).sum())]


def _leaves(value) -> Iterator:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, (torch.Tensor, int, float, bool)):
        yield value


class StreamUnreadable(Exception):
    """The stream could not be read at this step, on some process (raised on every process)."""


class _NamedFiles(logging.Handler):
    """`datasets` logs the file it failed to read ("Failed to read file '...'") and raises pyarrow's error
    without it: the file name is taken from that record."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.files: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Failed to read file"):
            self.files.append(message.split("'")[1] if message.count("'") >= 2 else message)


class naming_files:
    """While a stream is read: remembers the files `datasets` reports it could not read."""

    def __enter__(self) -> _NamedFiles:
        self.handler, self.logger = _NamedFiles(), logging.getLogger("datasets")
        self.logger.addHandler(self.handler)
        return self.handler

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)


def describe_error(error: BaseException, files: list[str]) -> str:
    where = getattr(error, "filename", None) or (files[-1] if files else None)
    return (f"{where}: " if where and str(where) not in str(error) else "") + f"{type(error).__name__}: {first_line(error)}"


@dataclass
class _Step:
    batches: list  # this process's share of each micro-batch (samples; evaluation: (samples, real))
    samples: int  # samples read in the epoch after this step
    state: Any  # the stream's state_dict() after this step's last sample, or None
    resumed: dict | None = None  # how a resumed epoch reached its position


@dataclass
class _End:
    samples: int  # samples read in the epoch (the last incomplete global batch included)
    resumed: dict | None = None


@dataclass
class _Failed:
    error: BaseException
    samples: int
    files: list[str]
    trace: str | None = None  # the traceback, when raised in a worker process


_END = object()


class _Reading(IterableDataset):
    """What the reader worker process iterates: the loader's items of one epoch."""

    def __init__(self, loader: "StreamLoader", epoch: int, skip: int, state):
        self.loader, self.epoch, self.skip, self.state = loader, epoch, skip, state

    def __iter__(self):
        # The stream must give the same samples in the worker as in a thread (a stream that sees a DataLoader worker
        # may split or reorder itself). The worker is acc_trainer's alone: the stream is not told.
        with patches.worker_info_hidden():
            for item in self.loader._produce(self.epoch, self.skip, self.state, worker=True):
                # One pickled step, its tensors as numpy arrays: the DataLoader would pass each sample's tensors
                # through shared memory one by one (a file descriptor each, 25x slower for small samples), and
                # pickling a torch tensor costs 0.1 ms (a 64-sample step: 8 ms to pickle, 8 ms to unpickle; as
                # arrays, 0.2 ms).
                try:
                    if isinstance(item, _Step):
                        item.batches = _arrays(item.batches)
                    yield pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as e:  # noqa: BLE001 - a sample that cannot travel: handed to the loop like any failure
                    yield pickle.dumps(_Failed(_portable(e), getattr(item, "samples", 0), [], traceback.format_exc()))
                    return


def _as_is(item):
    return item


class _Array:
    """A tensor on its way from the reader worker, as a numpy array."""

    def __init__(self, tensor: torch.Tensor):
        self.array = tensor.numpy()


def _arrays(value):
    """Samples with their plain CPU tensors as _Array (subclasses such as torchvision's BoundingBoxes, and what
    numpy cannot hold, as they are)."""
    if type(value) is torch.Tensor:
        if value.device.type != "cpu" or value.requires_grad or value.layout != torch.strided:
            return value
        try:
            return _Array(value.resolve_conj().resolve_neg())
        except (TypeError, RuntimeError):  # bfloat16, float8: numpy has no such dtype
            return value
    if isinstance(value, Mapping):
        return type(value)({k: _arrays(v) for k, v in value.items()}) if type(value) is dict else value
    if type(value) in (list, tuple):
        return type(value)(_arrays(v) for v in value)
    return value


def _tensors(value):
    if isinstance(value, _Array):
        return torch.from_numpy(value.array)
    if type(value) is dict:
        return {k: _tensors(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_tensors(v) for v in value)
    return value


def _portable(error: BaseException) -> BaseException:
    """An exception that can travel back from the worker process (pickled), else its description as one."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception may fail to pickle
        kind = OSError if isinstance(error, OSError) else RuntimeError
        return kind(f"{type(error).__name__}: {first_line(error)}")


class StreamLoader:
    """Batches of a stream for one process: `epoch(e, position)` for training (each step's micro-batch
    shares, on `device`), iteration for evaluation (`data.Uncollated` shares whose real size is known).

    batch: samples per step (training: the global batch; evaluation: the global evaluation batch),
    parts: micro-batches per step (grad_accum), world/rank: the processes, agree(list[int]) -> the sums over
    every process (None on one process), workers: 1 reads in a worker process, 0 in a thread, seed: --seed."""

    def __init__(self, dataset, batch: int, parts: int, world: int, rank: int, collate: Callable | None,
                 device: torch.device, agree: Callable | None, name: str, train: bool = True, workers: int = 0,
                 seed: int = 0):
        self.dataset, self.batch, self.parts, self.world, self.rank = dataset, batch, parts, world, rank
        self.collate, self.device, self.agree, self.name, self.train = collate or default_collate, device, agree, name, train
        self.saves_position = saves_position(dataset)
        self.resumed: dict | None = None  # how the last resume reached its position: how, samples, seconds
        self.workers = workers  # 0: a reader thread; 1: a reader worker process
        self.seed = seed  # with the epoch, seeds the worker's random number generators

    # ------------------------------------------------------------------ the process's share

    def _share(self, samples: list) -> list:
        """This process's slice of a micro-batch (Accelerate's split_batches slices alike)."""
        size = len(samples) // self.world
        return samples[self.rank * size:(self.rank + 1) * size]

    def _eval_share(self, samples: list) -> tuple[list, int]:
        """An evaluation batch split in contiguous shares, the first ones one sample longer when it does not
        divide; an empty share carries one stand-in sample (every process calls the model) and real = 0."""
        base, extra = divmod(len(samples), self.world)
        start = self.rank * base + min(self.rank, extra)
        mine = samples[start:start + base + (self.rank < extra)]
        return (mine, len(mine)) if mine else (samples[:1], 0)

    # ------------------------------------------------------------------ reading, ahead of the training

    def _samples(self, epoch: int, skip: int, state, resumed: dict) -> Iterator:
        """The stream's samples of `epoch` after its first `skip` (from the saved `state` when there is one);
        `resumed` is filled with how the position was reached, and how long it took."""
        start_epoch(self.dataset, epoch)
        since = time.perf_counter()
        if skip and state is not None and self.saves_position:
            self.dataset.load_state_dict(state)
            samples = iter(self.dataset)
            head = next(samples, _END)
            resumed.update(how="saved state", samples=skip, seconds=time.perf_counter() - since)
            if head is not _END:
                yield head
                yield from samples
            return
        samples = iter(self.dataset)
        if skip:  # read again from the epoch's start: the samples only, nothing collated
            skipped = sum(1 for _ in islice(samples, skip))
            resumed.update(how="skipped", samples=skipped, seconds=time.perf_counter() - since)
        yield from samples

    def _produce(self, epoch: int, skip: int, state, worker: bool = False) -> Iterator:
        """The epoch's steps as _Step items (this process's shares cut out, not collated: a collate function
        may draw random numbers, which must come in the run's order, in the training thread), then one _End,
        or a _Failed."""
        read, resumed = skip, {}
        with naming_files() as named:
            try:
                samples = self._samples(epoch, skip, state, resumed)
                while True:
                    chunk = list(islice(samples, self.batch))
                    read += len(chunk)
                    if not chunk or (self.train and len(chunk) < self.batch):
                        yield _End(read, resumed or None)
                        return
                    # A copy: a stream's own state may be a live dict, moved on by the reading ahead.
                    saved = copy.deepcopy(self.dataset.state_dict()) if self.saves_position else None
                    if self.train:
                        size = self.batch // self.parts
                        shares = [self._share(chunk[i * size:(i + 1) * size]) for i in range(self.parts)]
                    else:
                        shares = [self._eval_share(chunk)]
                    yield _Step(shares, read, saved, resumed or None)
            except Exception as e:  # noqa: BLE001 - handed to the loop, which decides (read error or bug)
                yield _Failed(_portable(e) if worker else e, read, list(named.files),
                              traceback.format_exc() if worker else None)

    def _thread(self, epoch: int, skip: int, state) -> Iterator:
        """The items of `_produce`, read ahead by a thread of this process (--num-workers 0)."""
        out, stop = queue.Queue(maxsize=AHEAD), threading.Event()

        def read() -> None:
            try:
                if self.device.type == "cuda":  # the current device is per thread: this process's
                    torch.cuda.set_device(self.device)
                for item in self._produce(epoch, skip, state):
                    _put(out, item, stop)
                    if stop.is_set() or not isinstance(item, _Step):
                        return
            except BaseException as e:  # noqa: BLE001 - SystemExit and the like: never leave the loop waiting
                _put(out, _Failed(e, skip, [], None), stop)

        reader = threading.Thread(target=read, daemon=True, name="acc_trainer-stream")
        reader.start()
        try:
            while True:
                yield out.get()
        finally:
            stop.set()
            deadline = time.monotonic() + LET_GO
            while reader.is_alive():  # let a reader blocked on a full queue see the stop
                if time.monotonic() > deadline:  # blocked in the stream's own read: it would keep the run waiting
                    print(f"acc-trainer: warning: the stream {self.name} is still in a read {LET_GO:.0f} s after the "
                          "run stopped reading it; its reader thread is left to end with the process", file=sys.stderr)
                    break
                try:
                    out.get(timeout=0.05)
                except queue.Empty:
                    pass

    def _worker(self, epoch: int, skip: int, state) -> Iterator:
        """The items of `_produce`, read ahead by one DataLoader worker process (one keeps the stream's order;
        the stream is read there, without competing with the training for Python's interpreter lock)."""
        alone = copy.copy(self)  # what the worker needs: not the collectives, nor the collate function
        alone.agree = alone.collate = None
        forked = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        reading = DataLoader(_Reading(alone, epoch, skip, state), batch_size=None, num_workers=1,
                             prefetch_factor=AHEAD, collate_fn=_as_is, multiprocessing_context=forked,
                             generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        read = skip
        try:
            for blob in reading:
                item = pickle.loads(blob)
                read = getattr(item, "samples", read)
                if isinstance(item, _Step):
                    item.batches = _tensors(item.batches)
                yield item
        except Exception as e:  # noqa: BLE001 - the worker died (killed for memory, say): every process hears of it
            yield _Failed(e, read, [], None)

    def _steps(self, epoch: int, skip: int, state) -> Iterator[_Step]:
        """The steps of one epoch, agreed on by every process: all have one, or the epoch ends; a failure on
        any process stops all."""
        items = (self._worker if self.workers else self._thread)(epoch, skip, state)
        try:
            for item in items:
                if getattr(item, "resumed", None):
                    self.resumed = item.resumed
                have, failed = isinstance(item, _Step), isinstance(item, _Failed)
                agreed = self.agree([int(have), int(failed)]) if self.agree else [int(have), int(failed)]
                if agreed[1]:
                    self._failure(item if failed else None, epoch)
                if agreed[0] < self.world:
                    if agreed[0]:
                        raise ConfigError(f"the {'training' if self.train else 'evaluation'} stream of {self.name} "
                                          "gives the processes different numbers of samples; every process must read the "
                                          "same stream (acc_trainer gives each its share)")
                    return
                yield item
        finally:
            items.close()  # the reader stops (thread joined, worker shut down)

    def _failure(self, failed: _Failed | None, epoch: int) -> None:
        """Every process raises, after the same gather: a read error as StreamUnreadable with the same line
        everywhere; a bug in the stream's code as itself on the process that met it (its traceback is the
        user's), and as one line naming that process on the others (which write no checkpoint)."""
        from accelerate.utils import gather_object

        from ..stopping import TrainingStopped

        split = "training" if self.train else "evaluation"
        mine = None if failed is None else [is_read_error(failed.error), describe_error(failed.error, failed.files),
                                            failed.samples, self.rank]
        reports = [mine] if self.world == 1 else gather_object([mine])
        if failed is not None and not is_read_error(failed.error):
            if failed.trace:  # raised in the reader's worker process: its traceback, as a note
                note = f"in acc_trainer's stream reader (a DataLoader worker process):\n{failed.trace}"
                if hasattr(failed.error, "add_note"):
                    failed.error.add_note(note)
                else:  # Python 3.10
                    print(note, file=sys.stderr)
            raise failed.error
        bug = next((r for r in reports if r is not None and not r[0]), None)
        if bug is not None:
            raise TrainingStopped(f"the {split} stream of {self.name} raised {bug[1]} on process {bug[3]} (its "
                                  "traceback is that process's)", code=1, alone=True)  # that one does not wait
        found = next(r for r in reports if r is not None)
        raise StreamUnreadable(f"the {split} stream of {self.name} cannot be read after sample {found[2]:,} of epoch "
                               f"{epoch + 1} ({found[1]})")

    # ------------------------------------------------------------------ training and evaluation

    def epoch(self, epoch: int, position: dict) -> Iterator:
        """Training micro-batches of `epoch` from `position` (samples already read in it, and the stream's
        state then); `position` is updated as each step is handed out (before its last micro-batch)."""
        from accelerate.utils import send_to_device

        self.resumed = None
        skip = position["samples"] if position.get("epoch") == epoch else 0
        for step in self._steps(epoch, skip, position.get("state")):
            for i, share in enumerate(step.batches):
                if i == len(step.batches) - 1:
                    position.update(epoch=epoch, samples=step.samples, state=step.state)
                yield send_to_device(self.collate(share), self.device, non_blocking=True)

    def __iter__(self):
        """Evaluation: every sample once, in shares of `data.Uncollated` with their real size."""
        for step in self._steps(0, 0, None):
            samples, real = step.batches[0]
            yield Uncollated(samples, self.collate, real=real)

    def check_start(self, what: str, at_least: int, heads=None) -> None:
        """An empty stream, or one shorter than `at_least` samples, is one line before anything runs; so is a
        saved position that a checkpoint cannot hold (trainer_state.json keeps it). `heads`: the run's first
        samples already read (datasets.Heads)."""
        got = len(first(self.dataset, at_least, f"the {what} stream of {self.name}", heads))
        if got == 0:
            raise ConfigError(f"the {what} stream of {self.name} is empty")
        if got < at_least:
            raise ConfigError(f"the {what} stream of {self.name} gives {got} samples, fewer than one global batch "
                              f"(--batch-size {at_least})")
        if self.train and self.saves_position:
            try:
                json.dumps(self.dataset.state_dict())
            except (TypeError, ValueError) as e:
                raise ConfigError(f"the {what} stream of {self.name}: its state_dict() must be plain data (numbers, "
                                  f"strings, lists, dicts) to be saved in checkpoints ({first_line(e)})") from None


def _put(out: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
