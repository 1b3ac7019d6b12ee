"""Augmentation that keeps every guarantee: the same augmented images on 1, 2 and 3 processes, with
accumulation and after a resume; the batched device path and the per-sample DataLoader path giving the
same pixels; and the distribution torchvision's transforms draw from."""

from __future__ import annotations

import pytest
import torch
from conftest import check, forked_cli, run_here, summary
from safetensors.torch import load_file
from test_checkpoints import interrupted
from test_data import write_cifar

from acc_trainer.config import TrainConfig
from acc_trainer.data.augment import Augment, crop_flip, resized_crop, trivial_augment, uniforms
from acc_trainer.data.datasets import InMemory, PerSample, augmented
from acc_trainer.workload.components import build_data

# The tests' own torch work on one thread (conftest.torch_on_one_thread): two test workers share 2 cores.
pytestmark = pytest.mark.usefixtures("torch_on_one_thread")

# 960 training images in CIFAR-10's files, 10 steps an epoch; every augmentation option at once. An MLP:
# LeNet with SGD at this learning rate is chaotic on these images (--grad-accum 2 alone, on one process and
# without augmentation, ends 4e-5 away from the plain run); the MLP ends 1e-7 away with everything on.
JOB = ["--dataset", "cifar10", "--model", "mlp", "--batch-size", "96", "--epochs", "2", "--optimizer", "sgd",
       "--lr", "0.05", "--augment", "trivialaugment", "--mixup", "0.2", "--cutmix", "1.0", "--label-smoothing", "0.1",
       "--ema", "0.9", "--log-every", "5", "--eval-batch-size", "50"]
# Added to every run but the 2-process one of `runs`, which keeps its figures: a process ends only after the main
# one has drawn them, as in a user's run (figures cost about 2 s a run, more than these runs train).
NO_PLOTS = ["--no-plots"]


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_cifar(root, "cifar10", train_per_file=192, test=200, classes=10)
    return root


@pytest.fixture(scope="module")
def runs(cifar, tmp_path_factory):
    """The augmented job on 1 process, on 2, with --grad-accum 2, and on 3 through the per-sample path (the
    1-process runs in this process, on one thread as a launched process runs)."""
    out = tmp_path_factory.mktemp("runs")
    job = [*JOB, "--data-dir", cifar]
    check(run_here(*job, *NO_PLOTS, "--output-dir", out / "1"))
    forked_cli(*job, "--output-dir", out / "2")
    check(run_here(*job, *NO_PLOTS, "--grad-accum", "2", "--output-dir", out / "accum"))
    forked_cli(*job, *NO_PLOTS, "--data-pipeline", "per-sample", "--num-workers", "1", "--output-dir", out / "3",
               processes=3)
    return out


def weights(run):
    return load_file(run / "model.safetensors")


def max_difference(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_every_topology_trains_on_the_same_augmented_images(runs):
    one = weights(runs / "1")
    for other in ("2", "accum", "3"):
        assert max_difference(one, weights(runs / other)) < 1e-5, other
        s = summary(runs / other)
        assert s["augment"] == "trivialaugment, mixup 0.2, cutmix 1.0" and s["weights"] == "ema (decay 0.9)"
        assert s["eval_samples"] == 200 and s["steps"] == 20
    assert summary(runs / "3")["world_size"] == 3


@pytest.mark.parametrize("world", [1, 2])
def test_an_augmented_run_stopped_and_resumed_is_the_same_run(runs, cifar, tmp_path, world):
    out = tmp_path / "run"
    job = [*JOB, "--data-dir", cifar, *NO_PLOTS]
    # SIGTERM in the 7th micro-batch: 1 process stops after step 7, 2 at the next log step (10, the epoch's end).
    first = interrupted(["--signal", "TERM", "--at", 7, "--rank", world - 1], "--output-dir", out, world=world, job=job)
    assert "stopped by SIGTERM" in first.stderr, first.stderr[-2000:]
    again = [*job, "--output-dir", out, "--resume", "auto"]  # continued here, or on processes forked from here
    printed = (check(run_here(*again)).stdout if world == 1 else
               forked_cli(*again, processes=world, output=tmp_path / "resumed.out"))
    assert "resuming at step" in printed
    reference, resumed = weights(runs / str(world)), weights(out)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)
    assert summary(out)["evals"] == summary(runs / str(world))["evals"]


@pytest.mark.parametrize("options", [dict(kind="standard"), dict(kind="trivialaugment", mixup=0.2, cutmix=1.0)])
def test_the_batched_and_per_sample_paths_give_the_same_pixels(cifar, options):
    batched = build_data(TrainConfig(dataset="cifar10", data_dir=str(cifar), batch_size=32))
    per_sample = build_data(TrainConfig(dataset="cifar10", data_dir=str(cifar), batch_size=32,
                                        data_pipeline="per-sample"))
    assert isinstance(batched.raw.train, InMemory) and not isinstance(per_sample.raw.train, InMemory)
    augment = Augment(seed=7, crop="pad", size=None, num_classes=10, train_size=960, **options)
    on_device, one_by_one = augmented(batched.raw, augment), augmented(per_sample.raw, augment)
    assert isinstance(one_by_one, PerSample)
    index = [3, 500, 17, 959, 0]
    images, targets = on_device.__getitems__(index)
    for row, i in enumerate(index):
        image, target = one_by_one[i]
        assert torch.equal(images[row], image) and torch.equal(targets[row], target)
    # A sample's augmentation does not depend on the batch it comes in, and changes with the epoch.
    assert torch.equal(on_device.__getitems__([17])[0][0], images[2])
    augment.set_epoch(1)
    assert not torch.equal(on_device.__getitems__([17])[0][0], images[2])
    # Without augmentation the training images are the evaluation pipeline's: normalised, not cropped.
    assert torch.equal(batched.train[17][0], per_sample.train[17][0])


def test_uniforms_depend_on_seed_epoch_and_index_only():
    index = torch.arange(20_000)
    u = uniforms(42, 3, index, 4)
    assert torch.equal(u[[5, 9]], uniforms(42, 3, index[[5, 9]], 4))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert (u != uniforms(42, 4, index, 4)).float().mean() > 0.999 and (u != uniforms(43, 3, index, 4)).float().mean() > 0.999
    corr = torch.corrcoef(u.T)
    assert (corr - torch.eye(4)).abs().max() < 0.03  # the columns are independent


def _mean_std(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    images = images.double()
    return images.mean(0), images.std(0)


def test_crops_and_flips_follow_torchvisions_distribution():
    """The random crop with padding and the flip, drawn from the hash, against torchvision's own
    RandomCrop(32, padding=4) + RandomHorizontalFlip over 4000 draws of one image: the same mean and
    spread at every pixel (a 2-pixel padding or no flip is told apart)."""
    from torchvision.transforms import v2

    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    n = 4000
    u = uniforms(0, 0, torch.arange(n), 3)
    ours = _mean_std(crop_flip(image.expand(n, -1, -1, -1), u))
    torch.manual_seed(0)
    reference = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()])
    theirs = _mean_std(torch.stack([reference(image) for _ in range(n)]))
    torch.manual_seed(1)
    again = _mean_std(torch.stack([reference(image) for _ in range(n)]))
    wrong = v2.Compose([v2.RandomCrop(32, padding=2), v2.RandomHorizontalFlip()])
    off = _mean_std(torch.stack([wrong(image) for _ in range(n)]))
    gap = lambda a, b: max((a[0] - b[0]).abs().mean().item(), (a[1] - b[1]).abs().mean().item())  # noqa: E731
    noise = gap(theirs, again)  # two torchvision samples differ by this much
    assert gap(ours, theirs) < 1.5 * noise < gap(off, theirs)


def test_resized_crops_follow_torchvisions_distribution():
    from torchvision.transforms import v2

    x, y = torch.arange(64.0).expand(48, 64), torch.arange(48.0)[:, None].expand(48, 64)
    image = torch.stack([x * 4, y * 5, (x - 32).abs() * 4 + (y - 24).abs() * 2]).to(torch.uint8)  # 64x48 ramps
    n = 1500
    u = uniforms(0, 0, torch.arange(n), 41)
    ours = _mean_std(torch.stack([resized_crop(image, row, 24) for row in u]))
    reference = v2.Compose([v2.RandomResizedCrop(24, antialias=True), v2.RandomHorizontalFlip()])
    torch.manual_seed(0)
    theirs = _mean_std(torch.stack([reference(image) for _ in range(n)]))
    torch.manual_seed(1)
    again = _mean_std(torch.stack([reference(image) for _ in range(n)]))
    wrong = v2.Compose([v2.RandomResizedCrop(24, scale=(0.3, 1), antialias=True), v2.RandomHorizontalFlip()])
    off = _mean_std(torch.stack([wrong(image) for _ in range(n)]))
    gap = lambda a, b: max((a[0] - b[0]).abs().mean().item(), (a[1] - b[1]).abs().mean().item())  # noqa: E731
    noise = gap(theirs, again)
    assert gap(ours, theirs) < 1.5 * noise < gap(off, theirs)


@pytest.mark.parametrize("height, width", [(8, 32), (40, 10)])
def test_a_crop_of_an_extreme_aspect_ratio_falls_back_as_torchvisions(height, width):
    """No try fits a 4:1 image (full area, ratio 3/4-4/3): torchvision then takes the central crop with the long
    side cut to the allowed ratio, which lies inside the image (no black border)."""
    from torchvision.transforms import RandomResizedCrop
    from torchvision.transforms.v2 import functional as TF

    image = torch.randint(0, 256, (3, height, width), dtype=torch.uint8)
    top, left, h, w = RandomResizedCrop.get_params(image, scale=(1.0, 1.0), ratio=(3 / 4, 4 / 3))
    assert 0 <= top and 0 <= left and top + h <= height and left + w <= width
    u = torch.ones(41)  # every try: the whole area, ratio 4/3; no flip
    assert torch.equal(resized_crop(image, u, 12), TF.resized_crop(image, top, left, h, w, [12, 12], antialias=True))


def test_trivialaugment_leaves_the_cuda_generators_alone(monkeypatch):
    """Seeding each image's operation must not reseed the GPU's generators (the model's dropout there)."""
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    before = torch.get_rng_state()
    out = trivial_augment(images, uniforms(0, 0, torch.arange(4), 1))
    assert out.shape == images.shape and reseeded == [] and torch.equal(torch.get_rng_state(), before)


def test_mixup_weights_follow_beta():
    from acc_trainer.data.augment import beta_quantile

    u = uniforms(1, 0, torch.arange(50_000), 1)[:, 0]
    for alpha in (0.2, 1.0):
        lam = beta_quantile(alpha, u)
        variance = 1 / (4 * (2 * alpha + 1))  # of Beta(alpha, alpha), whose mean is 1/2
        assert abs(lam.mean().item() - 0.5) < 0.01 and abs(lam.var().item() - variance) < 0.05 * variance
    assert beta_quantile(1.0, torch.tensor([0.25, 0.5, 0.9])).allclose(torch.tensor([0.25, 0.5, 0.9], dtype=torch.float64))


def test_ema_weights_are_the_average_of_the_trained_ones(train_in_process, tmp_path):
    """--ema 0.5 over 3 steps: 0.25 p1 + 0.25 p2 + 0.5 p3, p_i the trained weights each checkpoint holds."""
    s = train_in_process(model="mlp", train_size=96, eval_size=32, batch_size=32, epochs=1, optimizer="sgd",
                         lr=0.1, ema=0.5, checkpoint_every="1")
    out = tmp_path / "run1"
    steps = [load_file(out / "checkpoints" / f"step-{i:08d}" / "model.safetensors") for i in (1, 2, 3)]
    final = load_file(out / "model.safetensors")
    for k in final:
        expected = 0.25 * steps[0][k] + 0.25 * steps[1][k] + 0.5 * steps[2][k]
        assert torch.allclose(final[k], expected, atol=1e-6) and not torch.allclose(final[k], steps[2][k])
    assert s["weights"] == "ema (decay 0.5)" and s["augment"] == "none"


@pytest.mark.parametrize("args,message", [
    (["--dataset", "linear", "--model", "linreg", "--augment", "standard"],
     "--augment standard needs image samples ([C, H, W] tensors with a target); linear has inputs of shape [1]"),
    (["--dataset", "linear", "--model", "linreg", "--mixup", "0.2"], "needs image samples"),
    (["--mixup", "0.2", "--loss", "torch.nn.functional:nll_loss"],
     "apply to the cross_entropy loss; this run uses torch.nn.functional:nll_loss"),
    (["--label-smoothing", "1.5"], "--label-smoothing must be below 1, got 1.5"),
    (["--ema", "1"], "--ema takes a decay between 0 and 1"),
    (["--mixup", "inf"], "--mixup takes a Beta parameter from 0 (off) to 100, got inf"),
    (["--cutmix", "nan"], "--cutmix takes a Beta parameter from 0 (off) to 100, got nan"),
    (["--dataset", "fake", "--augment", "trivialaugment"],
     "--augment trivialaugment needs uint8 images (0-255); fake has torch.float32 images"),
    (["--augment", "random"], "argument --augment: invalid choice: 'random'"),
    (["--data-pipeline", "fast"], "argument --data-pipeline: invalid choice: 'fast'"),
])
def test_augmentation_mistakes_are_one_line(main_in_process, args, message):
    code, _, err = main_in_process("--train-size", "64", "--eval-size", "32", "--batch-size", "32", "--epochs", "1",
                                   *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_resnet18_cifar_keeps_32x32_images_at_4x4_in_its_last_stage():
    from acc_trainer.data.datasets import Data
    from acc_trainer.workload.models import MODELS

    model = MODELS["resnet18_cifar"](Data(None, None, "classification", 10, (3, 32, 32)))
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    seen = {}
    model.layer4.register_forward_hook(lambda m, i, o: seen.update(shape=tuple(o.shape)))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10) and seen["shape"] == (2, 512, 4, 4)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962  # kuangliu/pytorch-cifar's ResNet18: 11.17 M


def test_every_recipe_runs_as_written(tmp_path, main_in_process):
    """Each recipe, as its header's command runs it, on CIFAR files in the real format (a few steps of a small
    batch: their accuracy is cited, not reproduced here): it trains, and its options are the run's."""
    from conftest import REPO
    from test_data import write_cifar

    from acc_trainer.config import load_yaml

    write_cifar(tmp_path / "c10", "cifar10", train_per_file=8, test=16, classes=10)
    write_cifar(tmp_path / "c100", "cifar100", train_per_file=8, test=16, classes=100)
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(recipes) >= 4
    for recipe in recipes:
        given = load_yaml(recipe)
        assert f"--config recipes/{recipe.name}" in recipe.read_text(), recipe.name  # the command it documents
        data = tmp_path / ("c100" if given["dataset"] == "cifar100" else "c10")
        out = tmp_path / recipe.stem
        code, _, stderr = main_in_process("--config", recipe, "--data-dir", data, "--max-steps", "2", "--batch-size",
                                          "8", "--eval-batch-size", "8", "--no-plots",
                                          "--output-dir", out)
        assert code == 0, (recipe.name, stderr)
        ran = load_yaml(out / "config.yaml")
        assert {k: ran[k] for k in given if k not in ("batch_size",)} == \
            {k: v for k, v in given.items() if k != "batch_size"}, recipe.name
        assert summary(out)["steps"] == 2, recipe.name


def test_the_regression_recipe_reaches_the_notebooks_weights(tmp_path, main_in_process):
    from conftest import REPO

    code, _, stderr = main_in_process("--config", REPO / "recipes" / "linreg.yaml", "--output-dir", tmp_path / "run",
                                      "--no-plots")
    assert code == 0, stderr
    learned = weights(tmp_path / "run")  # the weights file, as a user reads it
    assert abs(learned["linear.weight"].item() - 2) < 0.01 and abs(learned["linear.bias"].item() - 3) < 0.01  # 1.9982, 3.0014


def test_augmentation_helps_a_small_training_set(monkeypatch, tmp_path):
    """The shapes example's circles, squares and triangles at random places: 256 training images are too
    few to learn every position; crops and flips show more of them (85.9 % -> 92.8 % on this CPU, on one thread;
    -s prints it)."""
    from accelerate.state import AcceleratorState, GradientState
    from conftest import REPO
    from torch.utils.data import TensorDataset

    import acc_trainer
    from acc_trainer.workload.models import LeNet

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    from shapes import load

    # Drawn once into tensors (a plain TensorDataset: the batched path) rather than per sample every epoch.
    train, evaluation = (TensorDataset(*map(torch.stack, zip(*[(x, torch.tensor(y))
                                                                for x, y in map(part.__getitem__, range(len(part)))])))
                         for part in load(train_size=256, eval_size=1000))
    results = {}
    for augment in ("none", "standard"):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc_trainer.set_seed(42)
        results[augment] = acc_trainer.fit(LeNet(32, 3), train, evaluation, augment=augment, epochs=30, batch_size=64,
                                           log_every=100, plots=False, progress="none",
                                           output_dir=str(tmp_path / augment))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plain, augmented_run = results["none"], results["standard"]
    print(f"shapes, 256 training images: {plain['eval']['accuracy']:.1%} without augmentation, "
          f"{augmented_run['eval']['accuracy']:.1%} with --augment standard")
    assert augmented_run["augment"] == "standard" and plain["augment"] == "none"
    assert augmented_run["eval"]["accuracy"] > plain["eval"]["accuracy"] + 0.01, (plain["eval"], augmented_run["eval"])
