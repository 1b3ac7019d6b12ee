"""Models by name, with the architectures of the tutorials the package grew from."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ConfigError
from .data import Data, torchvision


class LinReg(nn.Module):
    """y = w x + b: one input, one output."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class MLP(nn.Module):
    """Flattened image -> 512 -> classes (3072 inputs at 32x32)."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


class LeNet(nn.Module):
    """conv 3->6 k5, pool, conv 6->16 k5, pool, fc 400->120->84->classes (400 at 32x32 inputs)."""

    def __init__(self, image_size: int, num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def linreg(data: Data) -> nn.Module:
    if data.task != "regression" or data.input_shape != (1,):
        raise ConfigError("model linreg fits one input to one output: use it with --dataset linear")
    return LinReg()


def _image_classes(name: str, data: Data) -> tuple[int, int, int]:
    if data.task != "classification" or len(data.input_shape) != 3:
        raise ConfigError(f"model {name} classifies images: use it with an image dataset, not {data.task} data")
    return data.input_shape


def mlp(data: Data) -> nn.Module:
    c, h, w = _image_classes("mlp", data)
    return MLP(c * h * w, data.num_classes)


def lenet(data: Data) -> nn.Module:
    _, h, _ = _image_classes("lenet", data)
    if h < 16:
        raise ConfigError(f"model lenet needs images of at least 16x16, got {h}x{h}")
    return LeNet(h, data.num_classes)


def resnet18(data: Data) -> nn.Module:
    _image_classes("resnet18", data)
    return torchvision().models.resnet18(weights=None, num_classes=data.num_classes)


MODELS: dict[str, Callable[[Data], nn.Module]] = {
    "linreg": linreg,
    "mlp": mlp,
    "lenet": lenet,
    "resnet18": resnet18,
}


def build_model(name: str, data: Data) -> nn.Module:
    return MODELS[name](data)
