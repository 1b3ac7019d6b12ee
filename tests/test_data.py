"""Datasets from disk, in the formats torchvision reads, written small by the tests themselves."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check

from acc_trainer.config import ConfigError, TrainConfig
from acc_trainer.workload.components import build_data

# The tests' own torch work on one thread (conftest.torch_on_one_thread): two test workers share 2 cores.
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


def write_cifar(root: Path, name: str, train_per_file: int, test: int, classes: int) -> dict:
    """Files laid out and pickled as the python version of CIFAR-10/100 ships them."""
    rng = np.random.default_rng(0)

    def batch(n: int, label_key: str) -> dict:
        labels = rng.integers(0, classes, n)
        # A learnable image: the class shifts the red channel.
        images = rng.integers(0, 100, (n, 3, 32, 32)).astype(np.uint8)
        images[:, 0] += (labels * (150 // classes)).astype(np.uint8)[:, None, None]
        return {"data": images.reshape(n, 3072), label_key: labels.tolist(), "filenames": [f"{i}.png" for i in range(n)]}

    written = {}
    if name == "cifar10":
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        files = {f"data_batch_{i}": batch(train_per_file, "labels") for i in range(1, 6)}
        files["test_batch"] = batch(test, "labels")
        files["batches.meta"] = {"label_names": [f"class{i}" for i in range(classes)]}
    else:
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        files = {"train": batch(train_per_file * 5, "fine_labels"), "test": batch(test, "fine_labels"),
                 "meta": {"fine_label_names": [f"class{i}" for i in range(classes)]}}
    for file, content in files.items():
        with open(folder / file, "wb") as f:
            pickle.dump(content, f, protocol=2)
        written[file] = content
    return written


@pytest.mark.parametrize("name,classes,test_file", [("cifar10", 10, "test_batch"), ("cifar100", 100, "test")])
def test_cifar_loads_from_torchvision_layout(tmp_path, name, classes, test_file):
    written = write_cifar(tmp_path, name, train_per_file=40, test=37, classes=classes)
    data = build_data(TrainConfig(dataset=name, data_dir=str(tmp_path), batch_size=32))
    assert (len(data.train), len(data.eval), data.num_classes) == (200, 37, classes)
    image, label = data.eval[3]
    assert image.shape == (3, 32, 32) and label == written[test_file]["fine_labels" if name == "cifar100" else "labels"][3]
    # Pixels arrive as written, normalised with the dataset's mean and std.
    raw = torch.tensor(written[test_file]["data"][3].reshape(3, 32, 32), dtype=torch.float32) / 255
    from acc_trainer.data.datasets import CIFAR_MEAN_STD

    mean, std = (torch.tensor(v)[:, None, None] for v in CIFAR_MEAN_STD[name])
    torch.testing.assert_close(image, (raw - mean) / std)


def test_cifar10_trains_and_upscales(tmp_path, train_in_process):
    write_cifar(tmp_path, "cifar10", train_per_file=40, test=37, classes=10)
    s = train_in_process(model="lenet", dataset="cifar10", data_dir=str(tmp_path), batch_size=32, epochs=1,
                         image_size=64)
    assert s["eval_samples"] == 37 and s["steps"] == 200 // 32
    assert build_data(TrainConfig(dataset="cifar10", data_dir=str(tmp_path), image_size=64)).eval[0][0].shape == (3, 64, 64)


def test_corrupt_cifar_is_a_clear_error(tmp_path):
    write_cifar(tmp_path, "cifar10", train_per_file=8, test=8, classes=10)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:100])  # truncated, as by an interrupted copy
    with pytest.raises(ConfigError, match="cifar10 files in .*cifar-10-batches-py are incomplete or corrupted"):
        build_data(TrainConfig(dataset="cifar10", data_dir=str(tmp_path), batch_size=8))


def write_imagefolder(root: Path, per_class: dict[str, int]) -> None:
    from PIL import Image

    colours = {"red": (220, 30, 30), "green": (30, 220, 30), "blue": (30, 30, 220)}
    for split, n in per_class.items():
        for name, colour in colours.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                noise = np.random.default_rng(i).integers(-25, 25, (30 + i % 7, 40, 3))
                pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def test_imagefolder_trains_on_pngs(tmp_path, train_in_process):
    write_imagefolder(tmp_path, {"train": 24, "val": 7})
    # Images of several sizes cannot be batched as they are: one line asks for a size...
    with pytest.raises(ConfigError, match=r"the images differ in size \(.*is 40x30, .*is 40x31\); give --image-size N"):
        build_data(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), batch_size=8))
    # ...and --image-size resizes and centre-crops them.
    data = build_data(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), batch_size=8, image_size=32))
    assert (len(data.train), len(data.eval), data.num_classes) == (72, 21, 3)
    assert data.train[0][0].shape == (3, 32, 32)
    s = train_in_process(model="mlp", dataset="imagefolder", data_dir=str(tmp_path), image_size=32, batch_size=8,
                         epochs=3, optimizer="sgd", lr=0.01)
    assert s["eval_samples"] == 21 and s["augment"] == "none"  # a user's images: not augmented unless asked
    assert s["eval"]["accuracy"] == 1.0  # three flat colours: anything that learns separates them


def write_digits_imagefolder(root: Path) -> int:
    """scikit-learn's 8x8 handwritten digits as 32x32 RGB PNGs (each pixel a 4x4 block), every fifth to
    val/ and the rest to train/; returns the number of evaluation images."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        folder = root / ("val" if i % 5 == 0 else "train") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.kron((image * 255 / 16).astype(np.uint8), np.ones((4, 4), np.uint8))
        Image.fromarray(np.stack([pixels] * 3, axis=-1)).save(folder / f"{i}.png")
    return len(range(0, len(digits.images), 5))


def test_a_users_image_folder_is_left_as_it_is(tmp_path, train_in_process):
    """The digits at their own 32x32, no flag but the model and 8 epochs: no random resized crops of a user's images,
    no centre crop at evaluation. (It ends at 97.8 %, at 96.7 % or more from epoch 6 on. With the ImageNet crops
    that `--augment auto` used to apply here, the same run ended at 92.8-94.2 % after 10 epochs; with
    `--augment standard --image-size 32`, the same crops, at 91.7 % after 8.)"""
    evaluated = write_digits_imagefolder(tmp_path)
    data = build_data(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path)))
    from PIL import Image

    path, _ = data.train.base.samples[0]
    written = np.asarray(Image.open(path), dtype=np.float32).transpose(2, 0, 1) / 255 * 2 - 1
    assert data.train[0][0].shape == (3, 32, 32)
    assert np.allclose(data.train[0][0].numpy(), written, atol=1e-6)  # the pixels as written, normalised
    s = train_in_process(model="mlp", dataset="imagefolder", data_dir=str(tmp_path), epochs=8)
    assert s["augment"] == "none" and s["eval_samples"] == evaluated
    assert s["eval"]["accuracy"] >= 0.95
    # Its loader's two persistent worker processes ended with the run: they were left alive until a garbage
    # collection, which then waited 10 s for them.
    assert multiprocessing.active_children() == []


def test_imagefolder_evaluates_on_the_centre_and_trains_on_random_resized_crops(tmp_path):
    """With --image-size: evaluation resizes the short side to size / 0.875, then takes the central crop
    (torchvision's reference 256 -> 224), normalised; never random. Augmented training (--augment
    standard): RandomResizedCrop + flip."""
    from PIL import Image
    from torchvision import transforms as T

    from acc_trainer.data.augment import from_config
    from acc_trainer.data.datasets import augmented

    write_imagefolder(tmp_path, {"train": 3, "val": 2})
    config = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), batch_size=2, image_size=24,
                         augment="standard")
    data = build_data(config)
    path, _ = data.eval.base.samples[1]
    expected = T.Compose([T.PILToTensor(), T.Resize(round(24 / 0.875), antialias=True), T.CenterCrop(24),
                          T.ConvertImageDtype(torch.float32), T.Normalize((0.5,) * 3, (0.5,) * 3)])(Image.open(path))
    # Within one level of 255 (torchvision's two uint8 resize kernels round differently); another crop
    # of these noisy images would differ by tens of levels.
    assert (data.eval[1][0] - expected).abs().max() <= 2 / 255 + 1e-6
    assert torch.equal(data.eval[1][0], data.eval[1][0])
    augment = from_config(config, data)
    assert (augment.kind, augment.crop, augment.size) == ("standard", "resized", 24)
    train = augmented(data.raw, augment)
    crops = [train[4][0]]
    for epoch in (1, 2):
        augment.set_epoch(epoch)
        crops.append(train[4][0])
    assert all(c.shape == (3, 24, 24) for c in crops)
    assert not torch.equal(crops[0], crops[1]) and not torch.equal(crops[1], crops[2])
    augment.set_epoch(0)
    assert torch.equal(train[4][0], crops[0])  # a function of (seed, epoch, index): drawn again, the same


def test_imagefolder_with_mismatched_classes(tmp_path):
    write_imagefolder(tmp_path, {"train": 2, "val": 2})
    (tmp_path / "val" / "blue").rename(tmp_path / "val" / "purple")
    with pytest.raises(ConfigError, match="train/ and val/ have different classes"):
        build_data(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), batch_size=2))


def test_broken_torchvision_is_reported_not_a_crash(tmp_path):
    """A torchvision built for another torch fails at import; the package must still import and say so."""
    fake = tmp_path / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    # It imports; and then, in the same process, workloads that do not need torchvision still run (their
    # output to stderr, so that stdout holds what the import printed alone).
    code = ("import acc_trainer, acc_trainer.training.loop, acc_trainer.cli; print('imported', flush=True)\n"
            "import contextlib, sys\n"
            "with contextlib.redirect_stdout(sys.stderr):\n"
            f"    acc_trainer.cli.main(['--model', 'mlp', '--max-steps', '2', '--eval-size', '64', '--output-dir', "
            f"{str(tmp_path / 'ok')!r}])\n")
    imported = check(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True))
    assert imported.stdout == "imported\n"
    assert (tmp_path / "ok" / "summary.json").exists()
    result = subprocess.run([sys.executable, "-m", "acc_trainer", "--model", "resnet18", "--max-steps", "1",
                             "--output-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "acc-trainer: error: torchvision cannot be imported (operator torchvision::nms does not exist); install the "
        f"torchvision release built for torch {torch.__version__} (pip install torchvision)"
    )


def test_resnet18_trains_on_upscaled_images(train_in_process):
    """torchvision's ResNet-18 with num_classes set, on inputs upscaled as --image-size asks."""
    s = train_in_process(model="resnet18", image_size=64, train_size=32, eval_size=8, batch_size=16, max_steps=2,
                         optimizer="sgd", lr=0.01)
    assert (s["steps"], s["eval_samples"]) == (2, 8)
    from safetensors.torch import load_file

    weights = load_file(f"{s['output_dir']}/model.safetensors")
    assert weights["fc.weight"].shape == (10, 512)  # num_classes of the data, not ImageNet's 1000
    assert s["model_flops_per_sample"] == 869038080  # ResNet-18 at 64x64, as torch's FlopCounterMode counts


def test_a_generated_set_is_built_without_copies_of_it():
    """The synthetic set of 256 MiB peaks within 1.5x its size above the process's imports (it peaked at 3x: the
    prototypes, their scaled copy and the sum beside the noise), with the same samples as before."""
    import subprocess
    import sys

    from conftest import _env

    code = ("import resource, torch\n"
            "from acc_trainer.config import make_config\n"
            "from acc_trainer.data.datasets import synthetic\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "data = synthetic(make_config({'train_size': 21846, 'eval_size': 16}))\n"
            "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "print((peak - base) * 1024 / data.train.nbytes())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    ratio = float(result.stdout.split()[0])
    assert ratio <= 1.5, ratio
    # The same samples, bit for bit, as the whole-set formula gives (5,000 images: across a slice boundary).
    import torch.nn.functional as F

    from acc_trainer.config import make_config
    from acc_trainer.data.datasets import NUM_SYNTHETIC_CLASSES, synthetic

    g = torch.Generator().manual_seed(42)
    prototypes = F.interpolate(torch.randn(NUM_SYNTHETIC_CLASSES, 3, 4, 4, generator=g), size=(32, 32),
                               mode="bilinear", align_corners=False)
    labels = torch.randint(0, NUM_SYNTHETIC_CLASSES, (5000,), generator=g)
    expected = prototypes[labels] * 0.15 + torch.randn(5000, 3, 32, 32, generator=g)
    assert torch.equal(synthetic(make_config({"train_size": 5000, "eval_size": 16})).train.tensors[0], expected)
