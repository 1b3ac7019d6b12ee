"""Training augmentation whose every random choice is a function of (seed, epoch, sample index).

In the usual pipelines each DataLoader worker draws crops and flips from its own generator, so the
same seed on 1 and on 2 processes trains on differently augmented images, and a resumed run sees
other crops than the run it continues. Here each sample's parameters are hashed from (--seed, epoch,
index) instead: whichever process, micro-batch or worker reads sample i in epoch e, and whether the
run was resumed or not, it is augmented the same way. The topology and resume guarantees of the
loop therefore hold with augmentation on (tests/test_augment.py checks both).

The same functions run on a whole batch on the training device (data.InMemory, one gather and a few
tensor ops per batch, as airbench crops and flips CIFAR on the GPU) and on one sample at a time in
DataLoader workers (data.PerSample: ImageFolder, or CIFAR through torchvision's PIL path): a sample
gets exactly the same pixels either way.

    standard        32x32 sets: random crop with 4 pixels of zero padding + horizontal flip;
                    ImageFolder: RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) + horizontal flip
    trivialaugment  standard, then torchvision's TrivialAugmentWide (one random op per sample)
    --mixup A       mix each image with a partner sample, weight lam ~ Beta(A, A)
    --cutmix A      paste a box of the partner sample, area 1 - lam, lam ~ Beta(A, A)

Mixup and cutmix follow torchvision.transforms.v2.MixUp / CutMix, with one change: the partner is a
sample of the whole training set drawn from the hash, not the next sample of the batch a process
holds (with 2 processes those batches are halves, so v2's pairs would depend on the topology).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

AUGMENTS = ("none", "standard", "trivialaugment")
PAD = 4  # pixels of zero padding of the random crop, as in the CIFAR ResNet recipes
_M32 = 0xFFFFFFFF


def _mix(x):
    """A 32-bit integer hash with good avalanche (one of Chris Wellons' "hash prospector" finds), on int64
    tensors or Python ints. Both multipliers are below 2**31, so no product of a 32-bit value overflows
    int64 and `& _M32` is exactly the product mod 2**32."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def uniforms(seed: int, epoch: int, index: torch.Tensor, count: int) -> torch.Tensor:
    """[len(index), count] numbers in [0, 1), each a function of (seed, epoch, sample index, column) only.

    A counter-based generator: nothing is drawn from any RNG state, so the numbers do not depend on
    which process, worker or batch asks, or on what was asked before. Runs on index's device.
    """
    key = _mix((_mix(seed & _M32) + epoch * 0x9E3779B9) & _M32)
    base = _mix((index.long() & _M32) ^ key)
    columns = _mix((torch.arange(1, count + 1, device=index.device) * 0x632BE5AB) & _M32)  # made where used
    return _mix((base[:, None] + columns) & _M32).double() / 2.0**32


@dataclass
class Augment:
    kind: str  # "standard", "trivialaugment", or "none" (mixup/cutmix only)
    seed: int
    crop: str  # "pad": random crop with zero padding at the images' own size; "resized": RandomResizedCrop
    size: int | None  # output side of the "resized" crop
    mixup: float = 0.0
    cutmix: float = 0.0
    num_classes: int | None = None
    train_size: int = 0  # partners for mixup/cutmix are drawn from the whole training set
    # In shared memory, so that DataLoader workers (persistent ones included) see the loop's set_epoch.
    epoch: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long).share_memory_())

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    @property
    def mixes(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    def _draw(self, index: torch.Tensor, count: int, stream: int) -> torch.Tensor:
        # Separate streams for crops, trivialaugment and mixing, so that adding one changes no other.
        return uniforms(self.seed + stream * 0x5BD1E995, int(self.epoch), index, count)

    def images(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Crop, flip (and TrivialAugment) a batch [B, C, H, W] of raw images (uint8 or float)."""
        if self.kind == "none":  # mixing only
            return x
        if self.crop == "pad":
            x = crop_flip(x, self._draw(index, 3, 0).to(x.device))
        else:
            x = torch.stack([resized_crop(image, u, self.size)
                             for image, u in zip(x, self._draw(index, 41, 0).cpu(), strict=True)])
        if self.kind == "trivialaugment":
            x = trivial_augment(x, self._draw(index, 1, 1))
        return x

    def partners(self, index: torch.Tensor) -> torch.Tensor:
        return (self._draw(index, 1, 2)[:, 0] * self.train_size).long().clamp_(max=self.train_size - 1).to(index.device)

    def mix(self, x: torch.Tensor, y: torch.Tensor, px: torch.Tensor, py: torch.Tensor,
            index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample mixed with its partner (px, py): images float [B, C, H, W], targets -> class probabilities."""
        u = self._draw(index, 4, 3).to(x.device)
        # With both, each sample takes one of the two with probability 1/2 (v2.RandomChoice's default).
        use_cutmix = (u[:, 0] < 0.5) if (self.mixup and self.cutmix) else torch.full_like(u[:, 0], bool(self.cutmix),
                                                                                           dtype=torch.bool)
        lam = torch.where(use_cutmix, beta_quantile(self.cutmix or 1.0, u[:, 1]), beta_quantile(self.mixup or 1.0, u[:, 1]))
        B, _, H, W = x.shape
        # CutMix's box: centre uniform over the image, half sides r * (W, H) with r = sqrt(1 - lam) / 2,
        # clipped at the borders; lam becomes the area kept.
        cx, cy = (u[:, 2] * W).floor(), (u[:, 3] * H).floor()
        r = 0.5 * (1 - lam).clamp(min=0).sqrt()
        half_w, half_h = (r * W).floor(), (r * H).floor()
        x1, x2 = (cx - half_w).clamp(min=0), (cx + half_w).clamp(max=W)
        y1, y2 = (cy - half_h).clamp(min=0), (cy + half_h).clamp(max=H)
        cols = torch.arange(W, device=x.device, dtype=torch.float64)
        rows = torch.arange(H, device=x.device, dtype=torch.float64)
        box = (((rows[None, :, None] >= y1[:, None, None]) & (rows[None, :, None] < y2[:, None, None]))
               & ((cols[None, None, :] >= x1[:, None, None]) & (cols[None, None, :] < x2[:, None, None])))
        cut_lam = 1 - (x2 - x1) * (y2 - y1) / (W * H)
        lam = torch.where(use_cutmix, cut_lam, lam)
        mixed = torch.where(box[:, None], px, x)
        blended = x * lam.to(x.dtype).view(B, 1, 1, 1) + px * (1 - lam).to(x.dtype).view(B, 1, 1, 1)
        x = torch.where(use_cutmix.view(B, 1, 1, 1), mixed, blended)
        onehot = lambda t: F.one_hot(t.long(), self.num_classes).to(torch.float32)  # noqa: E731
        lam = lam.to(torch.float32)[:, None]
        return x, onehot(y) * lam + onehot(py) * (1 - lam)


def from_config(config, data) -> Augment | None:
    """The run's training augmentation (None: none), checked against its data."""
    from ..config import ConfigError

    kind = config.augment
    if kind == "auto":
        # The CIFAR recipe's augmentation for the built-in CIFAR sets; a user's own images (imagefolder,
        # their datasets) are left as they are unless the run asks.
        kind = "standard" if config.dataset in ("cifar10", "cifar100") else "none"
    mixes = config.mixup > 0 or config.cutmix > 0
    if kind == "none" and not mixes:
        return None
    what = f"--augment {kind}" if kind != "none" else "--mixup/--cutmix"
    if data.raw is None:
        raise ConfigError(f"{what} needs image samples ([C, H, W] tensors with a target); {config.dataset} has "
                          f"{'dict samples' if data.input_shape is None else f'inputs of shape {list(data.input_shape)}'}")
    if mixes and not (data.task == "classification" and data.num_classes):
        raise ConfigError(f"--mixup/--cutmix need class labels and a known number of classes; {config.dataset} has "
                          f"{data.task or 'no'} targets")
    if kind == "trivialaugment":
        dtype = torch.as_tensor(data.raw.train[0][0]).dtype
        if dtype != torch.uint8:  # torchvision's operations take floats as [0, 1] and clamp them there
            raise ConfigError(f"--augment trivialaugment needs uint8 images (0-255); {config.dataset} has {dtype} "
                              "images (use --augment standard, or give the dataset its uint8 images)")
    if kind == "none" and data.raw.crop == "resized":  # images of many sizes: only the random crop makes them one
        raise ConfigError(f"--mixup/--cutmix on {config.dataset} need --augment standard or trivialaugment")
    return Augment(kind, config.seed, data.raw.crop, data.raw.size, config.mixup, config.cutmix, data.num_classes,
                   len(data.raw.train))


def crop_flip(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Random crop with PAD pixels of zero padding, then a horizontal flip with probability 1/2, each
    sample its own (u: [B, 3] uniforms).

    One copy of whole rows for the batch: the padded images and their mirror images lie in one buffer,
    every output row is a run of W pixels in it (a flipped crop is the mirror image's crop at the
    mirrored offset), and `index_select` copies those runs: a CIFAR batch of 256 took 10 % less time on
    a CPU here than with a gather of single pixels (and a flip chosen by `torch.where` took longer still).
    """
    B, C, H, W = x.shape
    side_h, side_w = H + 2 * PAD, W + 2 * PAD
    both = x.new_zeros(2, B, C, side_h, side_w)
    both[0, :, :, PAD:PAD + H, PAD:PAD + W] = x
    both[1, :, :, PAD:PAD + H, PAD:PAD + W] = x.flip(3)
    dy = (u[:, 0] * (2 * PAD + 1)).long()
    dx = (u[:, 1] * (2 * PAD + 1)).long()
    flip = u[:, 2] < 0.5
    dx = torch.where(flip, 2 * PAD - dx, dx)
    plane = (flip.long() * B * C).view(B, 1, 1) + torch.arange(B * C, device=x.device).view(B, C, 1)
    starts = (plane * side_h + dy.view(B, 1, 1) + torch.arange(H, device=x.device)) * side_w + dx.view(B, 1, 1)
    flat = both.view(-1)
    runs = flat.as_strided((flat.numel() - W + 1, W), (1, 1))  # runs[i] = flat[i:i + W], no copy
    return runs.index_select(0, starts.view(-1)).view(B, C, H, W)


def resized_crop(image: torch.Tensor, u: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3, 10 tries then a central crop) and a
    horizontal flip, with the draws taken from u (41 uniforms) instead of the global RNG."""
    from torchvision.transforms.v2 import functional as TF

    H, W = image.shape[-2:]
    area = H * W
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    u = u.tolist()
    for attempt in range(10):
        a, b, c, d = u[4 * attempt: 4 * attempt + 4]
        target = area * (0.08 + a * (1 - 0.08))
        ratio = math.exp(log_ratio[0] + b * (log_ratio[1] - log_ratio[0]))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= W and 0 < h <= H:
            top, left = int(c * (H - h + 1)), int(d * (W - w + 1))
            break
    else:  # torchvision's fallback: the central crop, the image's long side cut to the allowed aspect ratio
        ratio = W / H
        if ratio < 3 / 4:  # tall
            w, h = W, round(W / (3 / 4))
        elif ratio > 4 / 3:  # wide
            w, h = round(H * 4 / 3), H
        else:
            w, h = W, H
        top, left = (H - h) // 2, (W - w) // 2
    out = TF.resized_crop(image, top, left, h, w, [size, size], antialias=True)
    return out.flip(-1) if u[40] < 0.5 else out


def trivial_augment(x, u: torch.Tensor):
    """torchvision's TrivialAugmentWide on each image (uint8), its random choices seeded from u: the
    transform draws from the global CPU generator, which is forked around every sample and seeded alone
    (torch.manual_seed would also reseed every CUDA generator: the model's dropout on a GPU)."""
    from torchvision.transforms import v2

    op = v2.TrivialAugmentWide()
    out = []
    for image, seed in zip(x, (u[:, 0] * 2**31).long().tolist(), strict=True):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            out.append(op(image))
    return torch.stack(out)


def beta_quantile(alpha: float, u: torch.Tensor) -> torch.Tensor:
    """The Beta(alpha, alpha) quantile of u, from a table: torch samples Beta only from its global RNG."""
    table = _quantile_table(alpha, u.device)
    position = u.double() * (len(table) - 1)
    low = position.floor().long().clamp(max=len(table) - 2)
    return torch.lerp(table[low], table[low + 1], position - low)


@functools.lru_cache(maxsize=16)  # a pure function of its arguments: copied to a device once, not every batch
def _quantile_table(alpha: float, device: torch.device) -> torch.Tensor:
    """The Beta(alpha, alpha) quantile function on a grid of u in [0, 1].

    The table integrates the density once: with s = x**alpha the integrand of the CDF on [0, 1/2] is
    (1 - s**(1/alpha))**(alpha - 1), bounded there; the upper half follows from symmetry.
    """
    s = np.linspace(0.0, 0.5**alpha, 200_001)
    f = (1 - s ** (1 / alpha)) ** (alpha - 1)
    cdf = np.concatenate([[0.0], np.cumsum((f[1:] + f[:-1]) / 2 * np.diff(s))])
    cdf = 0.5 * cdf / cdf[-1]
    x = s ** (1 / alpha)
    grid = np.linspace(0.0, 0.5, 4097)
    lower = np.interp(grid, cdf, x)
    return torch.from_numpy(np.concatenate([lower, 1 - lower[-2::-1]])).to(device)  # over u in [0, 1]
