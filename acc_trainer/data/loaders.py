"""The data loaders of a run: global micro-batches for training, exact per-process batches for evaluation.

`--batch-size` is the global batch of one optimizer step: the training loader yields micro-batches of
batch_size / grad_accum samples and Accelerate (`split_batches=True`) gives each process its slice.
Tensors in memory are served a whole batch at a time (`--data-pipeline batched`), from the training
device when they fit; other datasets one sample at a time through the DataLoader's workers.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from typing import Callable

import torch
from accelerate import DataLoaderConfiguration
from torch.utils.data import DataLoader, RandomSampler

from ..config import TrainConfig
from . import augment as augmentation
from .datasets import DATASETS, Data, IndexBatches, InMemory, Uncollated, augmented, one_at_a_time, steps_per_epoch
from .faults import Guarded
from .kinds import SetKind, set_kind
from .streams import StreamLoader


def dataloader_config(cfg: TrainConfig) -> DataLoaderConfiguration:
    """Each process takes its slice of every loader batch (so loader batches are global), and the
    shuffle is reseeded from --seed every epoch, identically on every process and in every run."""
    return DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=cfg.seed,
                                   non_blocking=True)  # copies from pinned memory overlap the GPU's work


def build_loaders(cfg: TrainConfig, data: Data, world: int, device: torch.device,
                  augment: augmentation.Augment | None = None,
                  collate: Callable | None = None, rank: int = 0, agree: Callable | None = None,
                  name: str = "the dataset") -> tuple:
    """The training loader yields global micro-batches; the evaluation loader `--eval-batch-size` per process
    (None without an evaluation set). With a user's `collate`, every sample goes through the DataLoader
    and each process collates its own slice of the global batch (Accelerate splits the indices); the
    evaluation loader hands over `Uncollated` samples (see there). A stream (an iterable dataset) gets a
    `streams.StreamLoader` instead, which already holds this process's share (`rank`; `agree` sums numbers
    over the processes), checked at its start."""
    per_process = cfg.eval_batch_size or cfg.batch_size // (world * cfg.grad_accum)
    kind = data.kind
    if kind.streams:
        return _with_streams(cfg, data, world, device, augment, collate, rank, agree, name, per_process)
    per_epoch = steps_per_epoch(data, cfg)
    # Exactly `per_epoch` whole global batches per epoch (the first per_epoch x batch_size indices of
    # each epoch's permutation): no partial step and no partial accumulation on any topology.
    # Over indices, not the dataset: Accelerate pickles the sampler into every checkpoint.
    sampler = RandomSampler(range(len(data.train)), num_samples=per_epoch * cfg.batch_size)
    micro_batch = cfg.batch_size // cfg.grad_accum
    train_set = augmented(data.raw, augment) if augment else data.train
    # An augmented set is made here, from the raw images: its kind is its own (the built-in sets' is data.train's).
    train_kind = set_kind(train_set, cfg.data_pipeline, collate) if augment else kind.train
    train_set = placed(train_set, train_kind, device)
    eval_set = placed(data.eval, kind.eval, device) if data.eval is not None else None
    workers = cfg.num_workers
    if workers is None:  # workers for the built-in datasets read per sample; a user's may not survive spawn
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        built_in = isinstance(cfg.dataset, str) and cfg.dataset in DATASETS  # a mixture's sets (a list) may be a user's
        workers = min(8, max(1, (os.cpu_count() or 1) // local - 1)) if not train_kind.batched and built_in else 0

    def loading(dataset) -> dict:
        if isinstance(dataset, InMemory) and dataset.tensors[0].device.type != "cpu":  # gathered right here
            return {"num_workers": 0, "pin_memory": False}
        return {"num_workers": workers, "pin_memory": device.type == "cuda", "persistent_workers": workers > 0}

    if train_kind.batched:  # whole batches at once
        batching = {"batch_sampler": IndexBatches(sampler, micro_batch), "collate_fn": InMemory.collate}
    else:
        batching = {"sampler": sampler, "batch_size": micro_batch, "drop_last": True, "collate_fn": collate}
        if train_kind.guarded:
            train_set, batching["collate_fn"] = Guarded(train_set), partial(Guarded.collate, collate=collate)
    # Each loader draws its workers' base seed from a generator of its own at every iteration, not from
    # the global RNG: a resumed run starts a new iteration mid-epoch, which would shift every random
    # number the model draws after it (dropout) against the uninterrupted run.
    train_loader = DataLoader(train_set, generator=torch.Generator().manual_seed(cfg.seed), **loading(train_set),
                              **batching)
    if eval_set is None:
        return train_loader, None
    return train_loader, evaluation_loader(eval_set, kind.eval, per_process * world, cfg.seed, loading(eval_set), collate)


def _with_streams(cfg: TrainConfig, data: Data, world: int, device: torch.device, augment, collate, rank: int,
                  agree: Callable | None, name: str, per_process: int) -> tuple:
    """Loaders when the training or the evaluation set is a stream (the other one may be map-style);
    `per_process`: the evaluation batch of one process."""
    if data.kind.train.stream:
        train_loader = StreamLoader(data.train, cfg.batch_size, cfg.grad_accum, world, rank, collate, device, agree, name,
                                    workers=stream_workers(cfg), seed=cfg.seed)
        train_loader.check_start("training", cfg.batch_size, data.heads)
    else:
        train_loader = build_loaders(cfg, replace(data, eval=None, kind=replace(data.kind, eval=None)), world, device, augment,
                                     collate)[0]
    if data.eval is None:
        return train_loader, None
    if not data.kind.eval.stream:
        eval_set = placed(data.eval, data.kind.eval, device)
        return train_loader, evaluation_loader(eval_set, data.kind.eval, per_process * world, cfg.seed, None, collate)
    return train_loader, stream_evaluation(cfg, data.eval, per_process * world, world, rank, collate, device, agree, name,
                                           data.heads)


def stream_evaluation(cfg: TrainConfig, dataset, global_batch: int, world: int, rank: int, collate: Callable | None,
                      device: torch.device, agree: Callable | None, name: str, heads=None) -> StreamLoader:
    """The loader of an evaluation stream (every sample once, in shares of `global_batch`), checked at its start
    (`heads`: the run's first samples already read, datasets.Heads)."""
    loader = StreamLoader(dataset, global_batch, 1, world, rank, collate, device, agree, name, train=False,
                          workers=stream_workers(cfg), seed=cfg.seed)
    loader.check_start("evaluation", 1, heads)
    return loader


def stream_workers(cfg: TrainConfig) -> int:
    """A stream is read ahead by a thread of each process (the default, --num-workers 0), or by one worker process
    (--num-workers 1 or more: one keeps the stream's order), which reads without competing with the training
    for Python's interpreter lock but starts anew every epoch and pickles every step (docs/large-data.md)."""
    return min(cfg.num_workers or 0, 1)


def evaluation_loader(dataset, kind: SetKind, global_batch: int, seed: int, loading: dict | None = None,
                      collate: Callable | None = None) -> DataLoader:
    """The dataset (as `placed` serves it) in its order, `global_batch` samples a batch (Accelerate splits each
    between the processes and pads the last one; evaluation and prediction leave that padding out)."""
    guarded = kind.guarded
    if guarded:
        eval_collate = partial(Guarded.collate, collate=collate)
    else:
        eval_collate = InMemory.collate if kind.batched else collate
    if collate:
        eval_collate = partial(Uncollated.later, collate=eval_collate)
    return DataLoader(Guarded(dataset) if guarded else dataset, batch_size=global_batch, shuffle=False,
                      generator=torch.Generator().manual_seed(seed), collate_fn=eval_collate,
                      **(loading or {"num_workers": 0}))


def on_device(loader: DataLoader | None, device: torch.device) -> bool:
    """Whether the loader's batches are gathered on `device` itself."""
    if loader is None or not isinstance(loader.dataset, InMemory):
        return False
    where = loader.dataset.tensors[0].device
    return where.type == device.type and device.index in (None, where.index)


def placed(dataset, kind: SetKind, device: torch.device):
    """Tensors in memory are served a batch at a time (the batched path), from the training device when they
    take at most half of its free memory; or one sample at a time (the per-sample path: `--data-pipeline
    per-sample`, or a collate function, which takes samples). Other datasets as they are."""
    if not kind.in_memory:  # a subclass of TensorDataset may have a __getitem__ of its own
        return dataset
    if not kind.batched:  # one sample per __getitem__, collated by the DataLoader
        return one_at_a_time(dataset)
    if not isinstance(dataset, InMemory):
        dataset = InMemory(*dataset.tensors)
    if device.type == "cuda" and dataset.nbytes() <= torch.cuda.mem_get_info(device)[0] // 2:
        dataset = dataset.on(device)
    return dataset


def placement(accelerator, train_loader, eval_loader) -> list:
    """Batches of tensors already on the training device need no copy: Accelerate's send_to_device would
    still walk every batch (12 us of a 90 us step of a small model here). DeepSpeed refuses the list (its room says
    so); FSDP2 and tensor parallelism ignore it."""
    return [None, None, *(False if on_device(loader, accelerator.device) else None
                          for loader in (train_loader, eval_loader)), None]


def workers_stopped(*loaders) -> None:
    """The loaders' worker processes end with the run that started them. A loader with persistent workers keeps them
    (torch 2.14: its iterator, in the private `_iterator`) as long as the loader lives, and a run's objects live on
    in reference cycles until a garbage collection: `fit()` returned with the workers alive, and the collection that
    ended them, whenever it came, waited 10 s for them."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and callable(getattr(iterator, "_shutdown_workers", None)):
            iterator._shutdown_workers()
            loader._iterator = None
