"""What the loop computes from a batch: the model call, losses and evaluation metrics by name.

Batches: a pair `(inputs, targets)` calls `model(inputs)` (`model(*inputs)` when inputs is a tuple
or list); a dict calls `model(**batch)`, and its targets are `batch["labels"]` (so a Hugging Face
model given labels computes its own loss).

Losses are `loss(outputs, targets) -> scalar`. Metrics are `metric(outputs, targets)` returning one
value per sample (shape `[batch]`, further dimensions averaged) or a scalar, the batch's mean; the
evaluation averages them over the samples of the evaluation set. Built-in losses and metrics read the
model's predictions from its outputs: the tensor itself, `outputs["logits"]` (or `.logits`), or the
first element of a tuple.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F


def forward(model, batch) -> tuple[Any, Any]:
    """The model's outputs for `batch`, and the batch's targets (None for a dict without labels)."""
    if isinstance(batch, Mapping):
        return model(**batch), batch.get("labels")
    inputs, targets = batch
    if isinstance(inputs, (tuple, list)):
        return model(*inputs), targets
    return model(inputs), targets


def own_loss(outputs) -> torch.Tensor | None:
    """The loss a model computed itself (a dict or output object with `loss`), or None."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def model_loss(outputs, targets) -> torch.Tensor:
    """The loss used when the model returns its own (`loss=None` and outputs that carry one)."""
    loss = own_loss(outputs)
    if loss is None:
        raise ValueError("the model's outputs carry no 'loss' (give a loss function)")
    return loss


def predictions(outputs) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise ValueError(f"cannot find the predictions in the model's outputs ({type(outputs).__name__}); "
                     "return a tensor, a tuple starting with one, or a dict with 'logits'")


def _class_scores(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Scores with the class dimension second, as torch's losses want: [B, C] and [B, C, ...] stay,
    [B, T, C] against targets [B, T] (a sequence model's logits) becomes [B, C, T]."""
    scores = predictions(outputs).float()
    if scores.dim() == targets.dim() + 1 and scores.shape[:-1] == targets.shape and scores.dim() > 2:
        return scores.movedim(-1, 1)
    return scores


def cross_entropy(outputs, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Targets are class indices, or class probabilities [B, C] (mixup, cutmix)."""
    return F.cross_entropy(_class_scores(outputs, targets), targets, label_smoothing=label_smoothing)


def _values(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Predictions in the targets' shape: [B, 1] against [B] is the same thing; anything else that
    differs is refused (torch would broadcast [B, 1] against [B] into [B, B] and warn)."""
    values = predictions(outputs).float()
    if values.shape != targets.shape:
        if values.numel() != targets.numel():
            raise ValueError(f"predictions {list(values.shape)} and targets {list(targets.shape)} differ in shape")
        values = values.reshape(targets.shape)
    return values


def mse(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(_values(outputs, targets), targets.float())


def l1(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(_values(outputs, targets), targets.float())


def smooth_l1(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(_values(outputs, targets), targets.float())


def bce_with_logits(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(_values(outputs, targets), targets.float())


def accuracy(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Per sample: 1 when the highest score is the target class (the mean over positions for
    sequences, ignoring targets of -100 as torch's cross-entropy does)."""
    return _per_sample_mean(_class_scores(outputs, targets).argmax(dim=1) == targets, targets)


def top5(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Per sample: 1 when the target class is among the five highest scores."""
    scores = _class_scores(outputs, targets)
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
    return (_values(outputs, targets) - targets.float()).abs().reshape(len(targets), -1).mean(1)


LOSSES: dict[str, Callable] = {
    "cross_entropy": cross_entropy,
    "mse": mse,
    "l1": l1,
    "smooth_l1": smooth_l1,
    "bce_with_logits": bce_with_logits,
}

METRICS: dict[str, Callable] = {
    "accuracy": accuracy,
    "top5": top5,
    "mae": mae,
}

# What a run trains with when no loss is named and the model computes none: by the data's task.
DEFAULTS = {"classification": (cross_entropy, {"accuracy": accuracy}), "regression": (mse, {})}
