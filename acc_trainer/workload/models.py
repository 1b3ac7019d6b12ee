"""Models by name, with the architectures of the tutorials the package grew from.

`MODELS` is the registry components.py resolves `--model` names in: each factory takes the run's
`data` (its task, number of classes and input shape), passed by name as a user's factory gets
`num_classes` or `data`. --init-from's weights are loaded here too (`initial_weights`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
from safetensors.torch import load_file
from torch import nn

from ..config import ConfigError, first_line
from ..data.datasets import Data, torchvision


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


class ConvNet(nn.Module):
    """A small CIFAR-sized network with BatchNorm: two conv-BN-ReLU-pool blocks, global average pool, linear."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


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


def convnet(data: Data) -> nn.Module:
    _image_classes("convnet", data)
    return ConvNet(data.num_classes)


def resnet18(data: Data) -> nn.Module:
    _image_classes("resnet18", data)
    return torchvision().models.resnet18(weights=None, num_classes=data.num_classes)


def resnet18_cifar(data: Data) -> nn.Module:
    """ResNet-18 for 32x32 images: torchvision's, with a 3x3 stride-1 first convolution and no max-pool, so
    that the 32x32 input reaches the last stage at 4x4 instead of 1x1 (kuangliu/pytorch-cifar's network,
    behind its 93-95 % on CIFAR-10)."""
    _image_classes("resnet18_cifar", data)
    model = torchvision().models.resnet18(weights=None, num_classes=data.num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


MODELS: dict[str, Callable[[Data], nn.Module]] = {
    "linreg": linreg,
    "mlp": mlp,
    "lenet": lenet,
    "convnet": convnet,
    "resnet18": resnet18,
    "resnet18_cifar": resnet18_cifar,
}


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm with batch statistics over all processes, for CPU (gloo) process groups.

    Written here because torch.nn.SyncBatchNorm runs on CUDA only (its kernels have no CPU backend
    and DDP refuses it on CPU modules). Same computation: per-channel sums and counts are summed
    over processes with torch.distributed.nn's all_reduce, which also carries the gradients back.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        channels, xf = x.size(1), x.float()
        local = torch.cat([xf.sum(dims), xf.square().sum(dims), xf.new_tensor([x.numel() // channels])])
        total = dist_nn.all_reduce(local)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels:-1] / count - mean.square()
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum if self.momentum is not None else 1 / self.num_batches_tracked.item()
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(var * count / (count - 1), momentum)  # unbiased, as BatchNorm keeps it
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def sync_batchnorm(model: nn.Module, device_type: str) -> nn.Module:
    """BatchNorm layers -> synchronised ones: torch's SyncBatchNorm on CUDA, CPUSyncBatchNorm elsewhere."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            synced = CPUSyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                      child.track_running_stats)
            synced.load_state_dict(child.state_dict())
            setattr(model, name, synced)
        else:
            sync_batchnorm(child, device_type)
    return model


def repeated_blocks(model: nn.Module) -> list[nn.ModuleList]:
    """The model's lists of repeated blocks (a ModuleList of two or more modules of one class: a transformers
    model's layers), outermost first, none inside another's blocks; none unless they hold most of the model's
    parameters (a detector's few lists of FPN convolutions beside its backbone are compiled with the whole model)."""
    found = _lists_of_blocks(model)
    inside = sum(p.numel() for blocks in found for p in blocks.parameters())
    return found if inside * 2 > sum(p.numel() for p in model.parameters()) else []


def _lists_of_blocks(model: nn.Module) -> list[nn.ModuleList]:
    found = []
    for child in model.children():
        if isinstance(child, nn.ModuleList) and len(child) > 1 and all(type(m) is type(child[0]) for m in child):
            found.append(child)
        else:
            found += _lists_of_blocks(child)
    return found


def compile_blocks(model: nn.Module, backend="inductor") -> int:
    """--compile on a model built of repeated blocks: each block compiled in place (nn.Module.compile, inductor),
    as Accelerate's regional compilation does, the rest of the model eager. Blocks of one class share their
    compiled code, so a 12-layer model compiles about one layer's worth (torch's regional compilation recipe),
    and in place the parameters keep their names: checkpoints and saved folders are the model's as built, with
    no `_orig_mod.` in them. Returns the number of blocks compiled."""
    count = 0
    for blocks in repeated_blocks(model):
        for block in blocks:
            block.compile(backend=backend)
            count += 1
    return count


_ABSENT = object()
# What Accelerate's `prepare` sets on the model object it is given (its class untouched): under mixed precision its
# autocast around `forward`, with the original kept as `_original_forward` (a compiled wrapper hands that one on to
# the module it wraps); and the mark that makes a later `prepare` of the object return it as it is.
ACCELERATE_MARKS = ("forward", "_original_forward", "_is_accelerate_prepared")


@contextmanager
def accelerate_marks_undone(model):
    """The model object a caller gave to fit(), evaluate() or predict() as it was given, whatever ended the run: the
    attributes of ACCELERATE_MARKS on it (and on a compiled wrapper's module) put back as they were before, so that
    its later use runs its own forward in its own precision, and a later run prepares it again (under its own
    precision). Not `unwrap_model(keep_fp32_wrapper=False)`: that follows `__wrapped__` to the innermost function,
    past the model's own decorators (transformers' `can_return_tuple`) and a compiled wrapper's forward, and leaves
    the mark."""
    own = getattr(model, "__dict__", {})
    holders = [h for h in (model, own.get("_modules", {}).get("_orig_mod")) if h is not None]
    saved = [(h, {name: h.__dict__.get(name, _ABSENT) for name in ACCELERATE_MARKS}) for h in holders]
    try:
        yield
    finally:  # plain dictionary writes: nothing here can hide the run's own error
        for holder, values in saved:
            for name, value in values.items():
                if value is _ABSENT:
                    holder.__dict__.pop(name, None)
                else:
                    holder.__dict__[name] = value


WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile's wrappers


def initial_weights(model, path: str, strict: bool = False) -> dict:
    """--init-from: loads what fits of `path` into `model` (every process reads the file, as it reads the
    data, so that all start from the same weights). Names are matched after removing wrapper prefixes;
    a tensor whose shape differs (a classifier head for another number of classes) keeps its fresh
    initialisation. Returns what happened, by name: loaded (a count), reset, missing, unexpected."""
    state = _weights_file(Path(path))
    clean = {}
    for name, tensor in state.items():
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        clean[name] = tensor
    own = model.state_dict()
    matched = {k: v for k, v in clean.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    loaded = {own[k].data_ptr() for k in matched}  # a tied weight, held once in the file, is loaded under either name
    report = {"from": str(path), "loaded": len(matched),
              "reset": sorted(k for k in clean if k in own and k not in matched),
              "missing": sorted(k for k in own if k not in clean and own[k].data_ptr() not in loaded),
              "unexpected": sorted(k for k in clean if k not in own)}
    if strict and (report["reset"] or report["missing"] or report["unexpected"]):
        first = next(f"{kind} {names[0]}" for kind, names in (("reset", report["reset"]), ("missing", report["missing"]),
                                                               ("unexpected", report["unexpected"])) if names)
        raise ConfigError(f"--init-from {path} does not match the model exactly (--init-strict): {len(report['reset'])} "
                          f"of another shape, {len(report['missing'])} missing, {len(report['unexpected'])} unexpected; "
                          f"first: {first}")
    if not matched:
        raise ConfigError(f"--init-from {path}: none of its {len(clean)} tensors fits the model (names such as "
                          f"{next(iter(clean), '-')!r} against {next(iter(own), '-')!r})")
    model.load_state_dict(matched, strict=False)
    return report


def _weights_file(path: Path) -> dict:
    """The tensors of a weights file, or of a run folder's / checkpoint's model.safetensors."""
    if path.is_dir():
        inner = path / "model.safetensors"
        if not inner.is_file():
            raise ConfigError(f"--init-from {path}: the folder holds no model.safetensors (give a run folder, a "
                              "checkpoint of acc_trainer, or a weights file)")
        path = inner
    if not path.is_file():
        raise ConfigError(f"--init-from {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a file that is not weights is the user's input
        raise ConfigError(f"--init-from {path} is not a weights file: {type(e).__name__}: {first_line(e)}") from None
    for key in ("state_dict", "model", "model_state_dict"):  # checkpoints of other trainers hold the weights inside
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--init-from {path} holds {type(state).__name__}, not a dict of named tensors")
    return state
