"""A user's own project, as files: a model module, a data module, metrics and a training script.

The tests write these into a folder and run acc_trainer on them the ways a user would: by import
path from that folder, and through `acc_trainer.fit` in a script of their own.
"""

MY_MODEL = '''
import os
import signal

import torch
from torch import nn


class Net(nn.Module):
    """16 features -> width -> classes, with optional dropout."""

    def __init__(self, num_classes, width=32, dropout=0.0):
        super().__init__()
        self.hidden = nn.Linear(16, width)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, num_classes)
        self.calls = 0

    def forward(self, x):
        if self.training:  # a preemption, as a scheduler sends it, at the Nth training batch of one process
            self.calls += 1
            if self.calls == int(os.environ.get("SIGTERM_AT_BATCH", 0)) and os.environ.get("RANK", "0") == "1":
                os.kill(os.getpid(), signal.SIGTERM)
        return self.out(self.drop(torch.relu(self.hidden(x))))


def build(num_classes, width=32):
    return Net(num_classes, width)


def broken(width=3):
    raise ValueError("width must be even")


class ImageNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.out(self.conv(x).mean(dim=(2, 3)))


class Buggy(Net):
    def forward(self, x):
        if self.training and self.calls == 2:
            return 1 / 0  # a bug in the user's own code, in the third training-mode call
        return super().forward(x)
'''

MY_DATA = '''
import torch
from torch.utils.data import TensorDataset


def load(train_size=512, eval_size=301, seed=0):
    """Four classes of 16-feature vectors, separable by a fixed random projection."""
    g = torch.Generator().manual_seed(seed)
    projection = torch.randn(16, 4, generator=g)

    def make(n):
        x = torch.randn(n, 16, generator=g)
        return TensorDataset(x, (x @ projection).argmax(1))

    return make(train_size), make(eval_size)


def regression(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g)
    y = x[:, :1] * 2 - 1
    return TensorDataset(x, y), TensorDataset(x[:100], y[:100])


def not_a_pair():
    return load()[0]
'''

BROKEN = '''
"""Workloads that break "the same run on 1 or N processes", each in its own way."""
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from my_model import Net


class NoisyData(TensorDataset):
    """A random transform drawing from the process's global generator."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn(x.shape), y


class PerProcessData(TensorDataset):
    """A dataset that holds one sample fewer on every further process."""

    def __len__(self):
        return super().__len__() - int(os.environ.get("RANK", "0"))


class RandomForward(Net):
    """torch.rand in forward, without a generator."""

    def forward(self, x):
        return super().forward(x + 0.1 * torch.rand(x.shape))


class BatchNormNet(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.hidden = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hidden(x))))
'''

MY_METRICS = '''
import torch.nn.functional as F


def top1_error(outputs, targets):
    """One value per sample: 1 where the highest score is not the target."""
    return (outputs.argmax(1) != targets).float()


def smooth_ce(outputs, targets):
    return F.cross_entropy(outputs, targets, label_smoothing=0.1)


def per_sample_loss(outputs, targets):
    return F.cross_entropy(outputs, targets, reduction="none")
'''

TRAIN_SCRIPT = '''
"""A user's training script: `python train_script.py DROPOUT [acc-trainer flags]`."""
import sys

import acc_trainer
from my_data import load
from my_model import Net


def main(argv):
    dropout, flags = float(argv[0]), argv[1:]
    config = acc_trainer.parse_config(["--batch-size", "64", "--epochs", "2", "--optimizer", "sgd", "--lr", "0.05",
                                       "--log-every", "4", *flags])
    acc_trainer.set_seed(config.seed)
    train, evaluation = load()
    return acc_trainer.fit(Net(4, dropout=dropout), train, evaluation, config=config)


if __name__ == "__main__":
    main(sys.argv[1:])
    # torch 2.14's gloo now and then aborts a finished multi-process script in the interpreter's teardown
    # (SIGABRT, after every file is written): leave without it, as docs/evaluation.md advises such a script.
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
'''

NOTEBOOK = '''
"""What a notebook cell does: notebook_launcher(function, num_processes=2)."""
import sys

from accelerate import notebook_launcher

import train_script

notebook_launcher(train_script.main, args=(sys.argv[2:],), num_processes=2, use_port=sys.argv[1])
'''

MODULES = ("my_model", "broken", "my_data", "my_metrics", "train_script")
FILES = {"my_model.py": MY_MODEL, "broken.py": BROKEN, "my_data.py": MY_DATA, "my_metrics.py": MY_METRICS,
         "train_script.py": TRAIN_SCRIPT, "notebook.py": NOTEBOOK}


def write(folder) -> None:
    for name, text in FILES.items():
        (folder / name).write_text(text.lstrip())
