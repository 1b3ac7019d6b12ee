"""Datasets by name: generated ones for offline work, and torchvision's CIFAR and ImageFolder.

Each builder takes the run's `config` and returns a `Data`: the training and evaluation sets plus what
the model and the loss need to know (task, number of classes, input shape). `DATASETS` is the registry
components.py resolves `--dataset` names in, the same way it calls a user's dataset factory. Builders
are called by every process inside `main_process_first()`, so a download happens once, on the main
process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, Dataset, TensorDataset

from .config import ConfigError, TrainConfig, first_line

NUM_SYNTHETIC_CLASSES = 10
CIFAR_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


@dataclass
class Data:
    train: Dataset
    eval: Dataset | None  # None: no evaluation
    task: str | None  # "classification" (integer targets), "regression" (real targets), None (no targets)
    num_classes: int | None  # None for regression, or when the dataset does not say
    input_shape: tuple[int, ...] | None  # of one sample, e.g. (3, 32, 32) or (1,); None for dict samples


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


class InMemory(TensorDataset):
    """Tensors held in memory, served a batch at a time.

    PyTorch's DataLoader asks a dataset with `__getitems__` for all indices of a batch at once: one
    indexing operation per tensor instead of a `__getitem__` per sample and a collate that stacks them
    (which costs more than the whole step of a small model). Use `InMemory.collate` as collate_fn.
    """

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices)
        return [t[index] for t in self.tensors]

    @staticmethod
    def collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return batch


class IndexBatches(BatchSampler):
    """Batches of indices as one tensor each, for `InMemory` datasets: the epoch's order is drawn once
    from the sampler and sliced, instead of collected index by index for every batch.

    Only with drop_last=True: Accelerate's sharding pads an incomplete last batch with `+`, which
    would add index tensors instead of joining lists.
    """

    def __init__(self, sampler, batch_size: int):
        super().__init__(sampler, batch_size, drop_last=True)

    def __iter__(self):
        order = torch.tensor(list(self.sampler))
        for batch in order.split(self.batch_size):
            if len(batch) == self.batch_size:
                yield batch


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
    def collate(items: list) -> tuple:
        from torch.utils.data import default_collate

        return default_collate([sample for sample, _ in items]), torch.tensor([index for _, index in items])


def reads_files(dataset: Dataset) -> bool:
    """Whether samples may fail to open: anything but tensors already in memory."""
    return not isinstance(dataset, (TensorDataset, Resized))


def sample_name(dataset: Dataset, index: int) -> str:
    """`path/to/file (OSError: why)` for ImageFolder-like datasets, else `sample N (...)`."""
    samples = getattr(dataset, "samples", None)
    name = str(samples[index][0]) if isinstance(samples, list) and index < len(samples) else f"sample {index}"
    try:
        dataset[index]
    except OSError as e:
        return f"{name} ({type(e).__name__}: {first_line(e)})"
    return name


def unreadable_samples(dataset: Dataset) -> list[str]:
    """Opens every sample once: the names of those that cannot be read."""
    bad = []
    for index in range(len(dataset)):
        try:
            dataset[index]
        except OSError:
            bad.append(sample_name(dataset, index))
    return bad


class Resized(Dataset):
    """Upscales the images of a tensor dataset per sample, as torchvision's Resize does for PIL images.

    With torch's interpolate rather than torchvision, so that the generated datasets keep working
    where torchvision cannot be imported."""

    def __init__(self, base: Dataset, size: int):
        self.base, self.size = base, size

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return x[0], y


def _maybe_resize(ds: InMemory, size: int, native: int) -> Dataset:
    return ds if size == native else Resized(ds, size)


def synthetic(config: TrainConfig) -> Data:
    """A learnable 10-class set of 3x32x32 images: a smooth random prototype per class plus noise.

    Made from `--seed` alone, so every process builds the same samples without touching the disk.
    """
    g = torch.Generator().manual_seed(config.seed)
    coarse = torch.randn(NUM_SYNTHETIC_CLASSES, 3, 4, 4, generator=g)
    prototypes = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)

    def make(n: int) -> InMemory:
        labels = torch.randint(0, NUM_SYNTHETIC_CLASSES, (n,), generator=g)
        noise = torch.randn(n, 3, 32, 32, generator=g)
        return InMemory(prototypes[labels] * 0.15 + noise, labels)

    size = _image_size(config)
    train, eval_ = make(config.train_size), make(config.eval_size)
    return Data(_maybe_resize(train, size, 32), _maybe_resize(eval_, size, 32), "classification",
                NUM_SYNTHETIC_CLASSES, (3, size, size))


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

    return Data(make(config.train_size), make(config.eval_size), "classification", 10, (3, size, size))


def _image_transform(config: TrainConfig, mean, std, resize: bool):
    transforms = torchvision().transforms
    size = _image_size(config)
    steps = [transforms.Resize((size, size))] if resize else []
    return transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(mean, std)])


def _image_size(config: TrainConfig) -> int:
    return config.image_size or 32


def cifar(config: TrainConfig) -> Data:
    """CIFAR-10/100 through torchvision, from --data-dir in torchvision's layout (downloaded there if online)."""
    cls = _cifar_class(config.dataset)
    root = Path(config.data_dir)
    mean, std = CIFAR_MEAN_STD[config.dataset]
    tf = _image_transform(config, mean, std, resize=_image_size(config) != 32)
    folder = root / CIFAR_FOLDERS[config.dataset]
    if not folder.is_dir():
        _download_cifar(cls, root, config.dataset, folder)
    try:
        train = cls(root=str(root), train=True, transform=tf, download=False)
        eval_ = cls(root=str(root), train=False, transform=tf, download=False)
    except Exception as e:  # torchvision says "Dataset not found or corrupted" or fails to unpickle
        raise ConfigError(f"{config.dataset} files in {folder} are incomplete or corrupted ({first_line(e)})") from None
    return Data(train, eval_, "classification", len(train.classes), (3, _image_size(config), _image_size(config)))


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
    """torchvision's ImageFolder on --data-dir/train and --data-dir/val, images resized to --image-size."""
    tv = torchvision()
    root = Path(config.data_dir)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ConfigError(f"imagefolder needs {root / split} with one sub-folder of images per class")
    tf = _image_transform(config, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), resize=True)
    try:
        train = tv.datasets.ImageFolder(str(root / "train"), transform=tf)
        eval_ = tv.datasets.ImageFolder(str(root / "val"), transform=tf)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"imagefolder {root}: {first_line(e)}") from None
    if train.classes != eval_.classes:
        raise ConfigError(
            f"imagefolder {root}: train/ and val/ have different classes ({train.classes} vs {eval_.classes})"
        )
    size = _image_size(config)
    return Data(train, eval_, "classification", len(train.classes), (3, size, size))


DATASETS: dict[str, Callable[[TrainConfig], Data]] = {
    "synthetic": synthetic,
    "linear": linear,
    "fake": fake,
    "cifar10": cifar,
    "cifar100": cifar,
    "imagefolder": imagefolder,
}


def check_data(data: Data, batch_size: int, name: str) -> None:
    if data.eval is not None and len(data.eval) == 0:
        raise ConfigError(f"the evaluation set of {name} is empty")
    if len(data.train) < batch_size:
        raise ConfigError(
            f"the training set of {name} has {len(data.train)} samples, fewer than one global batch "
            f"(--batch-size {batch_size})"
        )


def steps_per_epoch(data: Data, config: TrainConfig) -> int:
    """Whole global batches per epoch; the last incomplete one is dropped so every step sees a full batch."""
    return math.floor(len(data.train) / config.batch_size)
