"""A 1-D signal classifier: a small Conv1d network on generated waveforms (nothing here is an image).

Three classes of noisy waveforms: sine, square and sawtooth, each with a random frequency and phase.

    python examples/signal_classifier.py                    # trains with acc_trainer.fit
    python examples/signal_classifier.py --epochs 1 --mixed-precision bf16   # any acc-trainer option
    accelerate launch --multi_gpu --num_processes 2 examples/signal_classifier.py

The same pieces train from the command line, by import path (see signal.yaml):

    cd examples && acc-trainer --config signal.yaml
"""

import math
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import acc_trainer

CLASSES = ("sine", "square", "sawtooth")


def make_data(train_size: int = 4096, eval_size: int = 1000, length: int = 128, seed: int = 0):
    """(train, eval) datasets of (signal [1, length], class) pairs, made from `seed` alone."""
    g = torch.Generator().manual_seed(seed)

    def make(n: int) -> TensorDataset:
        labels = torch.randint(0, len(CLASSES), (n,), generator=g)
        frequency = 2 + 6 * torch.rand(n, 1, generator=g)
        phase = 2 * math.pi * torch.rand(n, 1, generator=g)
        t = torch.linspace(0, 1, length)[None] * frequency * 2 * math.pi + phase
        waves = torch.stack([torch.sin(t), torch.sign(torch.sin(t)), (t / math.pi) % 2 - 1])
        signal = waves[labels, torch.arange(n)] + 0.5 * torch.randn(n, length, generator=g)
        return TensorDataset(signal[:, None], labels)

    return make(train_size), make(eval_size)


class SignalNet(nn.Module):
    def __init__(self, num_classes: int, channels: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 7, padding=3), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
        )
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def main(argv: list[str]) -> dict:
    # Defaults for this example first; any acc-trainer flag given on the command line overrides them.
    config = acc_trainer.parse_config(["--epochs", "4", "--batch-size", "64", "--lr", "3e-3", *argv])
    acc_trainer.set_seed(config.seed)  # the same initial weights on every process
    train_data, eval_data = make_data(seed=config.seed)
    return acc_trainer.fit(SignalNet(num_classes=len(CLASSES)), train_data, eval_data, config=config)


if __name__ == "__main__":
    main(sys.argv[1:])
