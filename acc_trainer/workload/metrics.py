"""Built-in evaluation metrics, by name.

A metric is either
- a function `metric(outputs, targets)` returning one value per sample (shape `[batch]`, further
  dimensions averaged) or a scalar, the batch's mean; the evaluation averages them over the samples of
  the evaluation set, each sample counted once whatever the number of processes (accuracy, top5, mae); or
- a metric with state, for numbers that are not means of per-sample values (F1, AUROC, mAP): an object
  with `update(predictions, targets)`, `compute()` and `reset()` (torchmetrics' protocol), updated with
  each evaluation batch's real samples only and computed once over the whole set. Such an object combines
  the processes itself, as torchmetrics' do; the built-in ones (f1, precision, recall, auroc, iou, below)
  are combined by the loop: their counts with one all-reduce, their per-sample scores gathered exactly;
- or a function of the evaluation's loss over the whole set (FROM_LOSS: perplexity, the exponential of a
  token loss's token mean), computed once that loss is final, so exactly on any number of processes.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch

from .losses import class_scores, predictions, values_like


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


def perplexity(loss: float) -> float:
    """exp(the evaluation's loss): for a token loss, the exponential of the mean over every real token of the
    set (not of a mean of per-batch means)."""
    return math.inf if loss > 709 else math.exp(loss)  # beyond 709 float64 overflows; a NaN loss stays NaN


FROM_LOSS: dict[str, Callable[[float], float]] = {"perplexity": perplexity}


def from_loss(metric) -> bool:
    """A metric computed from the evaluation's loss (FROM_LOSS), not from the outputs."""
    return any(metric is fn for fn in FROM_LOSS.values())


# ------------------------------------------------------------------------------------ metrics with state


class Stateful:
    """A built-in metric over the whole evaluation set that is not a mean of per-sample values.

    `update(outputs, targets)` gets each evaluation batch's real samples only. Its state is `sums`, a
    tensor of counts that processes add up (one all-reduce), and/or `rows`, per-sample values that are
    concatenated over the processes (exactly the real samples, for AUROC); the loop merges both and
    calls `compute(sums, rows)`, which returns a number, or a dict with a number under "value" and
    tables beside it. Built from the first evaluation outputs (`for_outputs`), so that every process
    holds a state of the same shape from the start, even one that gets no real sample."""

    width = 0  # values per row (rows are kept only when width > 0)

    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        self.reset()

    @classmethod
    def for_outputs(cls, outputs, targets) -> "Stateful":
        scores = class_scores(outputs, targets)
        return cls(max(2, scores.shape[1]) if scores.dim() > 1 else 2)  # one logit: two classes

    def reset(self) -> None:
        self.sums = torch.zeros(self.size(), dtype=torch.float64)
        self.rows = []

    def size(self) -> tuple:
        return (self.num_classes, self.num_classes)  # a confusion matrix: [target, predicted]

    def update(self, outputs, targets: torch.Tensor) -> None:
        predicted = class_scores(outputs, targets).argmax(dim=1)
        keep = targets != -100
        pairs = targets[keep].long() * self.num_classes + predicted[keep]
        counts = torch.bincount(pairs.flatten(), minlength=self.num_classes ** 2)
        self.sums = self.sums.to(counts.device) + counts.reshape(self.num_classes, self.num_classes)

    def compute(self, sums: torch.Tensor, rows: torch.Tensor | None):
        raise NotImplementedError


def per_class(confusion: torch.Tensor) -> dict[str, torch.Tensor]:
    """Precision, recall, F1 and support of every class from a confusion matrix [target, predicted]; a
    class that is neither a target nor predicted is left out of macro averages (as scikit-learn does)."""
    confusion = confusion.double().cpu()
    hits = confusion.diagonal()
    predicted, support = confusion.sum(0), confusion.sum(1)
    precision = hits / predicted.clamp(min=1)
    recall = hits / support.clamp(min=1)
    f1 = 2 * hits / (predicted + support).clamp(min=1)
    return {"precision": precision, "recall": recall, "f1": f1, "support": support, "seen": (predicted + support) > 0}


class F1(Stateful):
    """`f1`: macro F1 over the classes (from the confusion counts); Precision and Recall the same way."""

    column = "f1"  # of per_class's table

    def compute(self, sums, rows):
        table = per_class(sums)
        return table[self.column][table["seen"]].mean().item()


class Precision(F1):
    """`precision`: macro precision over the classes."""

    column = "precision"


class Recall(F1):
    """`recall`: macro recall over the classes."""

    column = "recall"


class Confusion(Stateful):
    """The confusion matrix and the per-class table of a classification run (kept beside the metrics)."""

    def compute(self, sums, rows):
        table = per_class(sums)
        return {"confusion_matrix": sums.long().tolist(),
                "per_class": [{"precision": p, "recall": r, "f1": f, "support": int(s)} for p, r, f, s in
                              zip(*(table[k].tolist() for k in ("precision", "recall", "f1", "support")), strict=True)]}


class AUROC(Stateful):
    """`auroc`: the area under the ROC curve, exact (every real sample's score, ties counted half): binary
    (one score per sample, or two classes) or the macro mean of one-vs-rest over the classes."""

    def size(self) -> tuple:
        return (0,)

    @property
    def width(self) -> int:
        return self.num_classes + 1  # the class probabilities, then the target

    def update(self, outputs, targets: torch.Tensor) -> None:
        scores = predictions(outputs).detach().float()
        if scores.dim() == 1 or scores.shape[1] == 1:  # one logit: class 1's score
            scores = torch.stack([-scores.reshape(-1), scores.reshape(-1)], 1)
        probabilities = scores.double().softmax(dim=1)  # float32 saturates at 1.0 for logits 17 apart
        self.rows.append(torch.cat([probabilities.double(), targets.reshape(-1, 1).double()], 1))

    def compute(self, sums, rows):
        scores, targets = rows[:, :-1], rows[:, -1].long()
        if self.num_classes == 2:
            return auroc(scores[:, 1], targets == 1)
        areas = [auroc(scores[:, c], targets == c) for c in range(self.num_classes) if (targets == c).any()
                 and (targets != c).any()]
        return sum(areas) / len(areas) if areas else float("nan")


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The Mann-Whitney statistic: the chance that a positive sample scores above a negative one, ties half."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = scores.argsort()
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    # Tied scores share the mean of their ranks.
    unique, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(scores.dtype)
    mean_rank = ends - (counts.to(scores.dtype) - 1) / 2
    ranks[order] = mean_rank[inverse]
    return ((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


class IoU(Stateful):
    """`iou`: mean intersection over union of segmentation outputs [B, C, H, W] against class maps
    [B, H, W] (-100 ignored), over the classes present in the targets or the predictions."""

    def size(self) -> tuple:
        return (2, self.num_classes)  # intersections, unions

    def update(self, outputs, targets: torch.Tensor) -> None:
        predicted = class_scores(outputs, targets).argmax(dim=1)
        keep = targets != -100
        t, p = targets[keep].long(), predicted[keep]
        c = self.num_classes
        both = torch.bincount(t[t == p], minlength=c)
        union = torch.bincount(t, minlength=c) + torch.bincount(p, minlength=c) - both
        self.sums = self.sums.to(both.device) + torch.stack([both, union])

    def compute(self, sums, rows):
        intersection, union = sums
        seen = union > 0
        return (intersection[seen] / union[seen]).mean().item() if seen.any() else float("nan")


STATEFUL: dict[str, type] = {"f1": F1, "precision": Precision, "recall": Recall, "auroc": AUROC, "iou": IoU}


def is_stateful(metric) -> bool:
    """A metric with state: one of the built-ins above, or an object with update, compute and reset
    (torchmetrics' protocol; such an object combines the processes itself, as torchmetrics' do)."""
    return all(callable(getattr(metric, name, None)) for name in ("update", "compute", "reset"))


# ----------------------------------------------------------------------------------------- which is best

LOWER_IS_BETTER = re.compile(r"(^|_)(loss|error|mae|mse|perplexity)$")


def improves(metric: str, value: float, best: float | None, margin: float = 0.0) -> bool:
    """Whether `value` of `metric` beats `best` (None: nothing yet) by more than `margin`: lower for losses and
    errors, higher otherwise; NaN never does. The one definition of "better" (--save-best, --early-stop with
    its --min-delta, the summary, `acc-trainer report`)."""
    if math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value < best - margin if LOWER_IS_BETTER.search(metric) else value > best + margin


def ranked_by(evals: list[dict], metric: str | None = None) -> str | None:
    """What ranks a run's evaluations: `metric` (its --save-best or --early-stop), else accuracy, else the loss."""
    if metric:
        return metric
    names = set(evals[0]) if evals else set()
    return "accuracy" if "accuracy" in names else "loss" if "loss" in names else None


def best_evaluation(evals: list[dict], metric: str) -> dict | None:
    """The first evaluation whose `metric` no later one improves on (`improves`), or None."""
    best = None
    for e in evals:
        if metric in e and improves(metric, e[metric], best[metric] if best else None):
            best = e
    return best
