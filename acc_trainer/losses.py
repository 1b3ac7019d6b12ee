"""How a batch becomes outputs and a loss: the model call, the predictions in its outputs, built-in losses.

Batches: a pair `(inputs, targets)` calls `model(inputs)` (`model(*inputs)` when inputs is a tuple
or list); a dict calls `model(**batch)`, and its targets are `batch["labels"]` (so a Hugging Face
model given labels computes its own loss).

Losses are `loss(outputs, targets) -> scalar`. Built-in losses (and metrics.py's metrics) read the
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


def class_scores(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Scores with the class dimension second, as torch's losses want: [B, C] and [B, C, ...] stay,
    [B, T, C] against targets [B, T] (a sequence model's logits) becomes [B, C, T]."""
    scores = predictions(outputs).float()
    if scores.dim() == targets.dim() + 1 and scores.shape[:-1] == targets.shape and scores.dim() > 2:
        return scores.movedim(-1, 1)
    return scores


def cross_entropy(outputs, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Targets are class indices, or class probabilities [B, C] (mixup, cutmix)."""
    return F.cross_entropy(class_scores(outputs, targets), targets, label_smoothing=label_smoothing)


def values_like(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Predictions in the targets' shape: [B, 1] against [B] is the same thing; anything else that
    differs is refused (torch would broadcast [B, 1] against [B] into [B, B] and warn)."""
    values = predictions(outputs).float()
    if values.shape != targets.shape:
        if values.numel() != targets.numel():
            raise ValueError(f"predictions {list(values.shape)} and targets {list(targets.shape)} differ in shape")
        values = values.reshape(targets.shape)
    return values


def mse(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(values_like(outputs, targets), targets.float())


def l1(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(values_like(outputs, targets), targets.float())


def smooth_l1(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(values_like(outputs, targets), targets.float())


def bce_with_logits(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(values_like(outputs, targets), targets.float())


LOSSES: dict[str, Callable] = {
    "cross_entropy": cross_entropy,
    "mse": mse,
    "l1": l1,
    "smooth_l1": smooth_l1,
    "bce_with_logits": bce_with_logits,
}
