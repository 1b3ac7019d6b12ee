"""scikit-learn's handwritten digits (8x8 images, 10 classes, shipped with scikit-learn: nothing to download) and a
small MLP: the real small problem the sweep examples search (digits_sweep.yaml, digits_grid.yaml).

    cd examples && acc-trainer --model digits:DigitsNet --dataset digits:make_data --metrics accuracy
    cd examples && acc-trainer sweep digits_sweep.yaml
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_data(eval_share: float = 0.25, seed: int = 0):
    """(train, eval) datasets of (64 pixel values in [0, 1], digit) pairs: 1,797 images, split at random by `seed`."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x, y = torch.tensor(images, dtype=torch.float32) / 16, torch.tensor(labels)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    held = int(len(y) * eval_share)
    return TensorDataset(x[order[held:]], y[order[held:]]), TensorDataset(x[order[:held]], y[order[:held]])


class DigitsNet(nn.Module):
    def __init__(self, num_classes: int = 10, hidden: int = 64, dropout: float = 0.1):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
