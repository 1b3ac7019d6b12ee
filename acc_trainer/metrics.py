"""Built-in evaluation metrics, by name.

A metric is `metric(outputs, targets)` returning one value per sample (shape `[batch]`, further
dimensions averaged) or a scalar, the batch's mean; the evaluation averages them over the samples of
the evaluation set, each sample counted once whatever the number of processes.
"""

from __future__ import annotations

from typing import Callable

import torch

from .losses import class_scores, values_like


def accuracy(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Per sample: 1 when the highest score is the target class (the mean over positions for
    sequences, ignoring targets of -100 as torch's cross-entropy does)."""
    return _per_sample_mean(class_scores(outputs, targets).argmax(dim=1) == targets, targets)


def top5(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Per sample: 1 when the target class is among the five highest scores."""
    scores = class_scores(outputs, targets)
    best = scores.topk(min(5, scores.shape[1]), dim=1).indices
    return _per_sample_mean((best == targets.unsqueeze(1)).any(dim=1), targets)


def _per_sample_mean(hits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    hits = hits.float()
    if targets.dim() == 1:
        return hits
    valid = (targets != -100).float()
    return (hits * valid).flatten(1).sum(1) / valid.flatten(1).sum(1).clamp(min=1)


def mae(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Per sample: mean absolute error."""
    return (values_like(outputs, targets) - targets.float()).abs().reshape(len(targets), -1).mean(1)


METRICS: dict[str, Callable] = {
    "accuracy": accuracy,
    "top5": top5,
    "mae": mae,
}
