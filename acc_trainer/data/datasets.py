"""Datasets by name: generated ones for offline work, and torchvision's CIFAR and ImageFolder.

Each builder takes the run's `config` and returns a `Data`: the training and evaluation sets plus what
the model and the loss need to know (task, number of classes, input shape). `DATASETS` is the registry
components.py resolves `--dataset` names in, the same way it calls a user's dataset factory. Builders
are called by every process inside `main_process_first()`, so a download happens once, on the main
process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, Dataset, TensorDataset

from ..config import ConfigError, TrainConfig, first_line

IGNORE_INDEX = -100  # a target the loss leaves out (torch's cross-entropy default; Hugging Face labels use it)
NUM_SYNTHETIC_CLASSES = 10
CIFAR_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


@dataclass(frozen=True)
class SetKind:
    """How one set is read, decided where the run's data is built (kinds.settle)."""

    stream: bool  # an iterable dataset: each process reads its share in order (streams.py); else map-style
    in_memory: bool  # tensors held in memory (a TensorDataset or InMemory, not a subclass with its own __getitem__)
    batched: bool  # in memory and served a whole batch per gather (--data-pipeline batched, no collate function)
    guarded: bool  # samples come from code that may fail to open one (files): read through faults.Guarded
    length: int | None  # samples; None for a stream that does not say (learnt in its first epoch)


@dataclass(frozen=True)
class DataKind:
    """The kinds of a run's training and evaluation sets (`eval` None: no evaluation set)."""

    train: SetKind
    eval: SetKind | None
    packed: bool  # --pack: the sets are blocks of documents (packing.Packed, or a packing.PackedStream)

    @property
    def streams(self) -> bool:
        """Whether either set is a stream (the loaders, the checks of both then go the stream's way)."""
        return self.train.stream or (self.eval is not None and self.eval.stream)


@dataclass
class Data:
    train: Dataset
    eval: Dataset | None  # None: no evaluation
    task: str | None  # "classification" (integer targets), "regression" (real targets), None (no targets)
    num_classes: int | None  # None for regression, or when the dataset does not say
    input_shape: tuple[int, ...] | None  # of one sample, e.g. (3, 32, 32) or (1,); None for dict samples
    raw: RawImages | None = None  # for augmentation; None: the training set cannot be augmented
    heads: Heads = field(default_factory=lambda: Heads(), compare=False, repr=False)  # its streams' first samples
    notes: list[str] = field(default_factory=list, compare=False)  # what the checks of its labels found
    kind: DataKind | None = field(default=None, compare=False)  # decided once by kinds.settle where the data is built


class Heads:
    """The first samples of a run's streams, read once for every check at start (opening a stream can cost)
    and let go once the run is set up. Held per run, found by the stream object itself."""

    def __init__(self):
        self.held: list[tuple] = []  # (stream, its first samples, whether that is all of it)

    def get(self, dataset, n: int) -> list | None:
        for stream, samples, complete in self.held:
            if stream is dataset and (len(samples) >= n or complete):
                return samples[:n]
        return None

    def keep(self, dataset, samples: list, complete: bool) -> None:
        self.held = [h for h in self.held if h[0] is not dataset] + [(dataset, samples, complete)]

    def clear(self) -> None:
        self.held = []


def torchvision():
    """Import torchvision, or say clearly why it cannot be used (e.g. a build that does not match torch)."""
    try:
        import torchvision as tv
    except Exception as e:  # a mismatched build fails with RuntimeError or OSError, not only ImportError
        raise ConfigError(
            f"torchvision cannot be imported ({first_line(e)}); install the torchvision release built for "
            f"torch {torch.__version__} (pip install torchvision)"
        ) from None
    return tv


@dataclass
class Prepare:
    """How raw images become model inputs, a batch [B, C, H, W] at a time: uint8 to float in [0, 1],
    normalised per channel, resized to `size` (bilinear with antialiasing, as torchvision's Resize on
    tensors). Linear steps, so their order does not matter."""

    mean: tuple | None = None
    std: tuple | None = None
    size: int | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        owned = x.dtype != torch.float32  # then .to() copies, and the copy may be changed in place
        scale = 1.0 if x.is_floating_point() else 1 / 255  # uint8 to [0, 1]
        x = x.to(torch.float32)
        if self.mean is not None:  # (x * scale - mean) / std in two passes
            factor, shift = self._factor_shift(x.device, scale)
            x = x.mul_(factor).add_(shift) if owned else x * factor + shift
        elif scale != 1.0:
            x = x.mul_(scale)
        if self.size is not None and tuple(x.shape[-2:]) != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return x

    def _factor_shift(self, device: torch.device, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """scale / std and -mean / std on `device`, made once: a copy from the host at every batch would make the
        host wait for the device (on a GPU), where the batches are made ahead of the steps."""
        made = self.__dict__.setdefault("_made", {})
        if (device, scale) not in made:
            std = torch.tensor(self.std, device=device).view(1, -1, 1, 1)
            made[device, scale] = scale / std, -torch.tensor(self.mean, device=device).view(1, -1, 1, 1) / std
        return made[device, scale]


def make_batch(fetch: Callable, index: torch.Tensor, prepare: Prepare | None, augment, mix: bool = True):
    """Inputs and targets of the samples `index`, through augmentation and `prepare`: the one pipeline of
    both paths (InMemory for a whole batch, PerSample for one sample). fetch(index) -> raw (images, targets)."""
    x, y = fetch(index)
    if augment is not None:
        x = augment.images(x, index)
    if prepare is not None:
        x = prepare(x)
    if augment is not None and augment.mixes and mix:
        partners = augment.partners(index)
        px, py = make_batch(fetch, partners, prepare, augment, mix=False)
        x, y = augment.mix(x, y, px, py, index)
    return x, y


class InMemory(TensorDataset):
    """Tensors held in memory (on the training device when they fit there), served a batch at a time.

    PyTorch's DataLoader asks a dataset with `__getitems__` for all indices of a batch at once: one
    gather per tensor instead of a `__getitem__` per sample and a collate that stacks them (which
    costs more than the whole step of a small model). With `prepare` (uint8 to normalised float) and
    `augment`, the pair (images, targets) goes through them as a batch, where the tensors are.
    Use `InMemory.collate` as collate_fn.
    """

    def __init__(self, *tensors: torch.Tensor, prepare: Prepare | None = None, augment=None):
        super().__init__(*tensors)
        self.prepare, self.augment = prepare, augment
        self.side = None  # a CUDA stream the batches are made on while a training epoch reads them (`overlapped`)

    def __getitems__(self, indices) -> list[torch.Tensor]:
        if self.side is None:
            return self._batch(indices)
        with torch.cuda.stream(self.side):
            batch = self._batch(indices)
            made = self.side.record_event()
        for t in batch:
            t.made_on_side = made  # waited for by `ready`, on the stream that uses the batch
        return batch

    def _batch(self, indices) -> list[torch.Tensor]:
        index = torch.as_tensor(indices).to(self.tensors[0].device, non_blocking=True)
        # index_select: 60x faster than t[index] for a batch of CIFAR images on a CPU (torch 2.14).
        if self.prepare is None and self.augment is None:
            return [t.index_select(0, index) for t in self.tensors]
        fetch = lambda i: (self.tensors[0].index_select(0, i), self.tensors[1].index_select(0, i))  # noqa: E731
        return list(make_batch(fetch, index, self.prepare, self.augment))

    def __getitem__(self, index: int) -> tuple:
        return tuple(t[0] for t in self._batch([index]))

    def on(self, device: torch.device, augment=None) -> "InMemory":
        """The same samples with their tensors on `device` (and `augment` for training)."""
        return InMemory(*(t.to(device) for t in self.tensors), prepare=self.prepare, augment=augment or self.augment)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @staticmethod
    def collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return batch


def overlapped(batches, dataset, device: torch.device):
    """A training epoch's batches, each made on a side CUDA stream while the device computes the steps before it.

    Accelerate's DataLoaderShard asks for batch n + 1 before it hands out batch n, so the gather, augmentation and
    `prepare` of the next batch (data.InMemory's, on the device) are queued ahead of step n; on the default stream
    they would run between the steps, and the GPU would wait for them (2.4-2.9 ms of a 17-21 ms CIFAR step on an
    H100). On a side stream they run beside step n; `ready` makes the step that uses a batch wait for it on the
    device (no host synchronisation). Same kernels on the same data: the pixels are those of the default stream.
    Elsewhere (a CPU, or batches not made by InMemory) the batches as they are."""
    if device.type != "cuda" or type(dataset) is not InMemory or not dataset.tensors[0].is_cuda:
        yield from batches
        return
    if getattr(dataset, "stream", None) is None:
        dataset.stream = torch.cuda.Stream(device)
    dataset.stream.wait_stream(torch.cuda.current_stream(device))  # the set's tensors are written before it reads
    iterator = iter(batches)
    while True:
        dataset.side = dataset.stream  # only while the loader makes batches: nothing else reads the set on it
        try:
            batch = next(iterator)
        except StopIteration:
            return
        finally:
            dataset.side = None
        yield ready(batch)


def ready(batch):
    """The batch, with the current stream made to wait for the tensors made on a side stream (and their memory
    kept from reuse until the current stream's work on them is done)."""
    for t in batch if isinstance(batch, (list, tuple)) else ():
        made = getattr(t, "made_on_side", None)
        if made is not None:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(made)
            t.record_stream(current)
    return batch


def one_at_a_time(dataset: Dataset) -> Dataset:
    """Tensors held in memory as a dataset of single samples (prepared as InMemory prepares its batches),
    for a DataLoader that collates samples; any other dataset as it is."""
    if type(dataset) not in (TensorDataset, InMemory):  # a subclass may have a __getitem__ of its own
        return dataset
    plain = TensorDataset(*dataset.tensors)
    if isinstance(dataset, InMemory) and (dataset.prepare or dataset.augment):
        return PerSample(plain, dataset.prepare, dataset.augment)
    return plain


class PerSample(Dataset):
    """A dataset read one sample at a time (in DataLoader workers when there are), each raw image
    passed through the same pipeline as InMemory's batches: identical pixels for the same sample."""

    def __init__(self, base: Dataset, prepare: Prepare | None = None, augment=None):
        self.base, self.prepare, self.augment = base, prepare, augment

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y = make_batch(self._fetch, torch.tensor([index]), self.prepare, self.augment)
        return x[0], y[0]

    def _fetch(self, index: torch.Tensor):
        x, y = self.base[int(index[0])]
        return x[None], torch.as_tensor(y)[None]

    def __getattr__(self, name: str):  # the base's classes, targets, samples (file names)
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)


@dataclass
class RawImages:
    """What training augmentation starts from: the training images before `prepare`."""

    train: Dataset  # yields (raw image [C, H, W] uint8 or float, class)
    prepare: Prepare | None  # applied after augmentation
    crop: str = "pad"  # "pad": 32x32-style random crop with padding; "resized": RandomResizedCrop to `size`
    size: int | None = None


def augmented(raw: RawImages, augment) -> Dataset:
    """The training set through `augment`: batched for tensors in memory, else per sample."""
    if type(raw.train) in (TensorDataset, InMemory) and len(raw.train.tensors) == 2:  # not a subclass's __getitem__
        return InMemory(*raw.train.tensors, prepare=raw.prepare, augment=augment)
    return PerSample(raw.train, raw.prepare, augment)


class IndexBatches(BatchSampler):
    """Batches of indices as one tensor each, for `InMemory` datasets: the epoch's order is drawn once
    from the sampler and sliced, instead of collected index by index for every batch.

    Only with drop_last=True: Accelerate's sharding pads an incomplete last batch with `+`, which
    would add index tensors instead of joining lists.
    """

    def __init__(self, sampler, batch_size: int):
        super().__init__(sampler, batch_size, drop_last=True)

    def __iter__(self):
        # fromiter: a third of the time of torch.tensor(list(...)), which inspects every int (50,000: 20 ms).
        order = torch.from_numpy(np.fromiter(self.sampler, dtype=np.int64))
        for batch in order.split(self.batch_size):
            if len(batch) == self.batch_size:
                yield batch


class Uncollated:
    """An evaluation batch's samples, collated only once the loop knows how many of them are real.

    Accelerate pads the last evaluation batch with samples from the start of the set. A batch made by
    a user's collate function can be any nesting of lists, tuples and dicts, in which the samples
    cannot be told apart from the parts of one sample (a list of images and a tuple of input tensors
    look alike), so it cannot be cut back to its real samples once collated: the samples are, before.
    """

    def __init__(self, samples: list, collate, real: int | None = None):
        self.samples, self.collate = samples, collate
        self.real = real  # known when the loader made the shares itself (a stream's); else found by gathering

    def __len__(self) -> int:
        return len(self.samples)

    def first(self, n: int):
        return self.collate(self.samples[:n])

    @staticmethod
    def later(samples: list, collate) -> "Uncollated":
        """The evaluation loader's collate_fn (with functools.partial): picklable for workers."""
        return Uncollated(samples, collate)


def synthetic(config: TrainConfig) -> Data:
    """A learnable 10-class set of 3x32x32 images: a smooth random prototype per class plus noise.

    Made from `--seed` alone, so every process builds the same samples without touching the disk.
    """
    g = torch.Generator().manual_seed(config.seed)
    coarse = torch.randn(NUM_SYNTHETIC_CLASSES, 3, 4, 4, generator=g)
    prototypes = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)

    size = _image_size(config)
    prepare = Prepare(size=size) if size != 32 else None  # upscaled a batch at a time, where the batch is

    def make(n: int) -> InMemory:
        labels = torch.randint(0, NUM_SYNTHETIC_CLASSES, (n,), generator=g)
        images = torch.randn(n, 3, 32, 32, generator=g)
        # The prototypes added in place, a slice at a time: the set's memory once, not four times over (the same
        # operations on every element as `prototypes[labels] * 0.15 + noise`, so the same bits).
        for start in range(0, n, 4096):
            part = images[start: start + 4096]
            part.copy_(prototypes[labels[start: start + 4096]] * 0.15 + part)
        return InMemory(images, labels, prepare=prepare)

    train = make(config.train_size)
    return Data(train, make(config.eval_size), "classification", NUM_SYNTHETIC_CLASSES, (3, size, size),
                RawImages(train, prepare))


def linear(config: TrainConfig) -> Data:
    """y = 2x + 3 + 0.1 * noise, the regression of the single-vs-DDP notebook."""
    g = torch.Generator().manual_seed(config.seed)

    def make(n: int) -> InMemory:
        x = torch.randn(n, 1, generator=g)
        return InMemory(x, 2 * x + 3 + 0.1 * torch.randn(n, 1, generator=g))

    return Data(make(config.train_size), make(config.eval_size), "regression", None, (1,))


def fake(config: TrainConfig) -> Data:
    """Random images and labels at the final size, for measuring throughput only (nothing to learn)."""
    g = torch.Generator().manual_seed(config.seed)
    size = _image_size(config)

    def make(n: int) -> InMemory:
        return InMemory(torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g))

    train = make(config.train_size)
    return Data(train, make(config.eval_size), "classification", 10, (3, size, size), RawImages(train, None))


def _v2():
    from torchvision.transforms import v2  # not imported by `import torchvision`

    return v2


def _image_size(config: TrainConfig) -> int:
    return config.image_size or 32


def cifar(config: TrainConfig) -> Data:
    """CIFAR-10/100 through torchvision, from --data-dir in torchvision's layout (downloaded there if online).

    Batched (the default): torchvision reads the pickles and the images stay one uint8 tensor, cropped,
    flipped and normalised a batch at a time where the batch is (on the GPU when training there).
    Per-sample: torchvision's dataset as it comes, every image through PIL in the DataLoader.
    """
    cls = _cifar_class(config.dataset)
    root = Path(config.data_dir)
    folder = root / CIFAR_FOLDERS[config.dataset]
    if not folder.is_dir():
        _download_cifar(cls, root, config.dataset, folder)
    to_tensor = None if config.data_pipeline == "batched" else _v2().PILToTensor()
    try:
        train = cls(root=str(root), train=True, transform=to_tensor, download=False)
        eval_ = cls(root=str(root), train=False, transform=to_tensor, download=False)
    except Exception as e:  # torchvision says "Dataset not found or corrupted" or fails to unpickle
        raise ConfigError(f"{config.dataset} files in {folder} are incomplete or corrupted ({first_line(e)})") from None
    size = _image_size(config)
    prepare = Prepare(*CIFAR_MEAN_STD[config.dataset], size=size)
    if config.data_pipeline == "batched":
        def tensors(ds) -> tuple[torch.Tensor, torch.Tensor]:  # torchvision's [N, 32, 32, 3] uint8 array, as NCHW
            return torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets)

        raw = InMemory(*tensors(train))
        train_set, eval_set = InMemory(*raw.tensors, prepare=prepare), InMemory(*tensors(eval_), prepare=prepare)
    else:
        raw, train_set, eval_set = train, PerSample(train, prepare), PerSample(eval_, prepare)
    return Data(train_set, eval_set, "classification", len(train.classes), (3, size, size), RawImages(raw, prepare))


def _cifar_class(name: str):
    """torchvision's CIFAR class, checking that its files exist rather than their md5 sums.

    torchvision reads the files exactly as before; a truncated or corrupt file fails when it is
    unpickled (reported as a ConfigError), and smaller files in the same format (tests, subsets) load.
    """
    base = torchvision().datasets.CIFAR10 if name == "cifar10" else torchvision().datasets.CIFAR100
    return type(base.__name__, (base,), {
        "train_list": [[file, None] for file, _ in base.train_list],
        "test_list": [[file, None] for file, _ in base.test_list],
        "meta": {**base.meta, "md5": None},
    })


def _download_cifar(cls, root: Path, name: str, folder: Path) -> None:
    from accelerate import PartialState

    if not PartialState().is_local_main_process:
        raise ConfigError(f"{name} was not found in {folder}, and the main process could not download it")
    try:
        root.mkdir(parents=True, exist_ok=True)
        cls(root=str(root), train=True, download=True)
    except Exception as e:
        raise ConfigError(
            f"{name} was not found in {folder} and could not be downloaded ({first_line(e)}); "
            f"put the extracted '{folder.name}' folder of the python version of the dataset in {root}"
        ) from None


def imagefolder(config: TrainConfig) -> Data:
    """torchvision's ImageFolder on --data-dir/train and --data-dir/val, read per sample in DataLoader workers.

    A user's own images are left as they are: at their own size, not augmented (`--augment auto` is
    none here), normalised to [-1, 1]. `--image-size N` (or augmentation, at N = 32 unless given) asks
    for a size: evaluation then resizes the short side to N / 0.875 and takes the central N x N crop
    (torchvision's reference recipe: 256 then 224), and augmented training takes RandomResizedCrop to
    N x N and a flip (augment.py).
    """
    tv, v2 = torchvision(), _v2()
    root = Path(config.data_dir)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ConfigError(f"imagefolder needs {root / split} with one sub-folder of images per class")
    resized = config.image_size is not None or config.augment in ("standard", "trivialaugment")
    size = _image_size(config)
    as_is = v2.PILToTensor()
    centre = v2.Compose([as_is, v2.Resize(round(size / 0.875), antialias=True), v2.CenterCrop(size)])
    try:
        train = tv.datasets.ImageFolder(str(root / "train"), transform=centre if resized else as_is)
        raw = tv.datasets.ImageFolder(str(root / "train"), transform=as_is)
        eval_ = tv.datasets.ImageFolder(str(root / "val"), transform=centre if resized else as_is)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"imagefolder {root}: {first_line(e)}") from None
    if train.classes != eval_.classes:
        raise ConfigError(
            f"imagefolder {root}: train/ and val/ have different classes ({train.classes} vs {eval_.classes})"
        )
    shape = (3, size, size) if resized else (3, *_one_size(train.samples + eval_.samples, root))
    prepare = Prepare((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    return Data(PerSample(train, prepare), PerSample(eval_, prepare), "classification", len(train.classes),
                shape, RawImages(raw, prepare, crop="resized", size=size))


def _one_size(samples: list[tuple[str, int]], root: Path) -> tuple[int, int]:
    """The (height, width) all the images share, read from their headers (the pixels are not decoded);
    the first image of another size stops the run with one line. A file that cannot be opened is left
    to the run, which names it (check-data lists them all)."""
    from PIL import Image

    first = None
    for path, _ in samples:
        try:
            with Image.open(path) as image:
                size = image.size
        except OSError:
            continue
        if first is None:
            first = (path, size)
        elif size != first[1]:
            (w, h), (w2, h2) = first[1], size
            raise ConfigError(f"imagefolder {root}: the images differ in size ({first[0]} is {w}x{h}, {path} is "
                              f"{w2}x{h2}); give --image-size N to resize and centre-crop them to N x N")
    width, height = first[1] if first else (_image_size(TrainConfig()), _image_size(TrainConfig()))
    return height, width


DATASETS: dict[str, Callable[[TrainConfig], Data]] = {
    "synthetic": synthetic,
    "linear": linear,
    "fake": fake,
    "cifar10": cifar,
    "cifar100": cifar,
    "imagefolder": imagefolder,
}


def check_data(data: Data, batch_size: int | None, name: str) -> None:
    """Empty sets, or a training set shorter than one global batch, are one line (streams: at their start,
    by their loaders). `batch_size` None: the data is not trained on (evaluate, predict), whatever its size."""
    if data.kind.streams:
        return
    if data.eval is not None and data.kind.eval.length == 0:
        raise ConfigError(f"the evaluation set of {name} is empty")
    if batch_size is not None and data.kind.train.length < batch_size:
        raise ConfigError(
            f"the training set of {name} has {data.kind.train.length} samples, fewer than one global batch "
            f"(--batch-size {batch_size})"
        )


def steps_per_epoch(data: Data, config: TrainConfig) -> int | None:
    """Whole global batches per epoch; the last incomplete one is dropped so every step sees a full batch.
    None for a stream that does not say its length (learnt in its first epoch)."""
    size = data.kind.train.length
    return None if size is None else math.floor(size / config.batch_size)
