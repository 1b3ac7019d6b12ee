"""A Dataset class of your own with a torchvision model: circles, squares and triangles.

`Shapes` draws 32x32 colour images on the fly in `__getitem__` (as a dataset reading files would
load them); `load` is the dataset factory the command line calls. From this folder:

    acc-trainer --model torchvision:resnet18 --dataset shapes:load --epochs 3 --batch-size 64   # 98 %
    acc-trainer --model torchvision:mobilenet_v3_small --dataset shapes:load --dataset-args '{train_size: 4000}'

`--model torchvision:<name>` builds any torchvision classification model with `num_classes` set from
`Shapes.classes`.
"""

import torch
from torch.utils.data import Dataset


class Shapes(Dataset):
    classes = ("circle", "square", "triangle")

    def __init__(self, size: int, seed: int, side: int = 32):
        self.size, self.seed, self.side = size, seed, side

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)  # sample i is always the same image
        label = int(torch.randint(0, 3, (), generator=g))
        radius = 5 + 6 * torch.rand((), generator=g)
        cy, cx = 8 + 16 * torch.rand(2, generator=g)
        y, x = torch.meshgrid(torch.arange(self.side), torch.arange(self.side), indexing="ij")
        dy, dx = y - cy, x - cx
        if label == 0:
            mask = dy**2 + dx**2 <= radius**2
        elif label == 1:
            mask = (dy.abs() <= radius * 0.85) & (dx.abs() <= radius * 0.85)
        else:
            mask = (dy <= radius * 0.7) & (dy >= -radius) & (dx.abs() <= (dy + radius) * 0.6)
        colour = 0.4 + 0.6 * torch.rand(3, 1, 1, generator=g)
        image = mask * colour + 0.15 * torch.randn(3, self.side, self.side, generator=g)
        return image, label


def load(train_size: int = 2000, eval_size: int = 500, seed: int = 0):
    """(train, eval): `seed` is the run's --seed, so the data follows the run's seed."""
    return Shapes(train_size, seed), Shapes(eval_size, seed + 1)
