"""How a batch becomes outputs and a loss: the model call, the predictions in its outputs, built-in losses.

Forward: `forward(model, batch) -> (outputs, targets)`. The default: a pair `(inputs, targets)` calls
`model(inputs)` (`model(*inputs)` when inputs is a tuple or list); a dict calls `model(**batch)`, and
its targets are `batch["labels"]` (so a Hugging Face model given labels computes its own loss).
`with_targets` is torchvision's detection convention: `model(inputs, targets)` while training,
`model(inputs)` in evaluation. A user's own function replaces them (`fit(forward=)`, `--forward`).

Losses are `loss(outputs, targets)` returning either
- one number (a 0-dim tensor): the mean over the batch's samples, or
- a pair `(sum, count)`: the sum of the losses of the batch's items (tokens, boxes, pixels) and how
  many items there are. The loop then divides by the items of the whole global batch, over every
  process and accumulation micro-batch, so a token counts the same wherever it lands.
With no loss given, the model's own is used: `outputs.loss` (counted per token when it is a
cross-entropy over labels with -100 ignored, see `own_items`), or the sum of a dict of named losses
(torchvision's detection models in training), each logged by name.

Built-in losses (and metrics.py's metrics) read the model's predictions from its outputs: the tensor
itself, `outputs["logits"]` (or `.logits`), or the first element of a tuple.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from accelerate.utils import recursively_apply
from torch.utils.checkpoint import checkpoint

from ..data.datasets import IGNORE_INDEX


def forward(model, batch) -> tuple[Any, Any]:
    """The model's outputs for `batch`, and the batch's targets (None for a dict without labels)."""
    if isinstance(batch, Mapping):
        return model(**batch, **no_cache(model, batch)), batch.get("labels")
    inputs, targets = batch
    if isinstance(inputs, (tuple, list)):
        return model(*inputs), targets
    return model(inputs), targets


def no_cache(model, batch: Mapping) -> dict:
    """`use_cache=False` where a transformers model's config keeps a cache that the forward has no use for (training
    and evaluation; generation does not come through here): to a model that generates (a causal LM, whose forward
    takes the option) and for a packed batch (position_ids, no attention_mask: packing.py). Such a model otherwise
    builds an empty cache in every forward, and
    - with a cache, transformers (5.x, masking_utils._preprocess_mask_arguments) ignores where a packed batch's
      position ids restart, so its documents would attend to each other;
    - blocks compiled in place (--compile, models.compile_blocks) are traced against their layer's entry of the cache,
      so each layer compiles again (a 12-layer Llama: 8 compilations, torch's limit, then the rest eager)."""
    if "use_cache" in batch:
        return {}
    for _ in range(3):  # through DDP's, DeepSpeed's and torch.compile's wrappers to the model's config
        if getattr(model, "config", None) is not None or not isinstance(getattr(model, "module", None), torch.nn.Module):
            break
        model = model.module
    keeps = getattr(getattr(model, "config", None), "use_cache", False) is True
    packed = "position_ids" in batch and "attention_mask" not in batch
    return {"use_cache": False} if keeps and (packed or hasattr(model, "generate") and _takes_use_cache(type(model))) \
        else {}


@functools.lru_cache(maxsize=None)
def _takes_use_cache(cls: type) -> bool:
    """Whether the class's forward takes `use_cache` (by name or through **kwargs): a model of one's own may not.
    Asked at every step, answered once per class (inspect.signature takes tens of microseconds)."""
    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def with_targets(model, batch) -> tuple[Any, Any]:
    """torchvision's detection models: `model(images, targets)` while training returns a dict of
    losses, `model(images)` in evaluation returns the predictions (a list of dicts)."""
    inputs, targets = batch
    return (model(inputs, targets) if model.training else model(inputs)), targets


FORWARDS: dict[str, Callable] = {"default": forward, "with_targets": with_targets}


@dataclass
class Loss:
    """One micro-batch's loss as the loop uses it."""

    value: torch.Tensor  # what backward takes: a mean over the samples, or a sum over `items` items
    items: torch.Tensor | None = None  # how many items `value` sums over; None: a mean over the samples
    parts: dict[str, torch.Tensor] | None = None  # a model's named losses, whose sum `value` is


class NotALoss(ValueError):
    """A loss function returned something else than one number or (sum, count)."""

    def __init__(self, value):
        super().__init__(f"a loss must return one number (a 0-dim tensor) or a pair (sum, count), not {_shape(value)}")
        self.value = value


def as_loss(value) -> Loss:
    """A loss function's result: one number, or `(sum, count)`."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return Loss(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], torch.Tensor) \
            and value[0].dim() == 0:
        return Loss(value[0], torch.as_tensor(value[1], device=value[0].device).reshape(()))
    raise NotALoss(value)


def batch_loss(model, batch, loss_fn: Callable, forward_fn: Callable | None = None) -> tuple[Any, Any, Loss | None]:
    """How one batch becomes the model's outputs, the batch's targets and the loss: the one place, for
    training and evaluation alike. `forward_fn(model, batch) -> (outputs, targets)` is the user's
    (fit(forward=), --forward), else losses.forward. The loss is a losses.Loss (`loss_fn` may return one
    number or (sum, count) too), or None when the outputs carry none (a model that returns predictions
    in evaluation)."""
    outputs, targets = (forward_fn or forward)(model, batch)
    loss = loss_fn(outputs, targets) if loss_fn is not None else None
    return outputs, targets, loss if loss is None or isinstance(loss, Loss) else as_loss(loss)


def model_inputs(batch, channels_last: bool, dtype: torch.dtype | None):
    """A batch as the model takes it: NHWC images for --channels-last, floating inputs in the weights'
    dtype under DeepSpeed. Targets (the pair's second item, a dict's labels) stay as they are; a batch of
    another shape (a user's forward function) is converted throughout."""
    if not channels_last and dtype is None:
        return batch

    def convert(t: torch.Tensor) -> torch.Tensor:
        if channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    if isinstance(batch, Mapping):
        return {k: v if k == "labels" else recursively_apply(convert, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        return [recursively_apply(convert, inputs), targets]
    return recursively_apply(convert, batch)


def own_loss(outputs) -> torch.Tensor | None:
    """The loss a model computed itself (a dict or output object with `loss`), or None."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def loss_parts(outputs) -> dict[str, torch.Tensor] | None:
    """A dict of named losses (torchvision's detection models in training: every key names a loss), or None.
    An entry that is not one number is an error."""
    if not (isinstance(outputs, Mapping) and outputs and "loss" not in outputs
            and all(isinstance(k, str) and "loss" in k for k in outputs)):
        return None
    for name, value in outputs.items():
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise ValueError(f"the model's loss {name!r} is {_shape(value)}; each loss in its dict must be one number")
    return dict(outputs)


def model_loss(outputs, targets, items: Callable | None = None) -> Loss | None:
    """The model's own loss (`loss=None`): `outputs.loss`, a sum over tokens when `items` counts them
    (see own_items), or the sum of a dict of named losses. None when the outputs carry no loss (a
    model returning predictions in evaluation)."""
    loss = own_loss(outputs)
    if loss is not None:
        if items is None:
            return Loss(loss)
        count = items(targets)
        # No item in the batch (every label -100): the model's mean is NaN; the sum is 0.
        return Loss(torch.where(count > 0, loss, loss.new_zeros(())) * count, count)
    parts = loss_parts(outputs)
    return Loss(sum(parts.values()), None, parts) if parts else None


def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE_INDEX).sum()


def count_next_tokens(targets: torch.Tensor) -> torch.Tensor:
    """A causal language model's: the labels are shifted inside it, so the first position predicts nothing."""
    return (targets[..., 1:] != IGNORE_INDEX).sum()


def own_items(outputs, targets, loss: torch.Tensor) -> Callable | None:
    """How the model's own loss counts its items, read off one batch: a cross-entropy over every target
    token (count_tokens), over the next tokens (count_next_tokens: Hugging Face's causal language
    models), or None (a mean over the samples, or a loss that is not such a cross-entropy)."""
    if not (isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.dim() >= 2):
        return None
    try:
        logits = predictions(outputs).detach().float()
    except ValueError:
        return None
    if logits.shape[:-1] != targets.shape:
        return None
    candidates = ((count_tokens, logits, targets), (count_next_tokens, logits[..., :-1, :], targets[..., 1:]))
    for count, scores, labels in candidates:
        mean = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
        if torch.isclose(mean, loss.detach().float(), rtol=1e-4, atol=1e-6):
            return count
    return None


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
    return scores.movedim(-1, 1) if _classes_last(scores, targets) else scores


def _classes_last(scores: torch.Tensor, targets: torch.Tensor) -> bool:
    return scores.dim() == targets.dim() + 1 and scores.shape[:-1] == targets.shape and scores.dim() > 2


def cross_entropy(outputs, targets: torch.Tensor, label_smoothing: float = 0.0):
    """Targets are class indices, or class probabilities [B, C] (mixup, cutmix). Per sample [B]: the
    mean over the samples; per position ([B, T] tokens, [B, H, W] pixels, -100 ignored): a sum over
    the positions and their count, normalised over the whole global batch. Tokens' scores [B, T, V] are
    taken in float32 a chunk of positions at a time (`chunked`)."""
    if targets.dim() >= 2 and not targets.is_floating_point():
        scores = predictions(outputs)
        if _classes_last(scores, targets):
            per_token = chunked(functools.partial(F.cross_entropy, label_smoothing=label_smoothing, reduction="none"),
                                scores.flatten(0, -2), targets.flatten())
            return per_token.sum(), count_tokens(targets)
        return (F.cross_entropy(scores.float(), targets, label_smoothing=label_smoothing, reduction="sum"),
                count_tokens(targets))
    return F.cross_entropy(class_scores(outputs, targets), targets, label_smoothing=label_smoothing)


# float32 elements of the scores that `chunked` takes at once (64 MiB; with fn's intermediates, a few times that). A
# 128k vocabulary over 4,096 tokens is 2 GiB a row in float32; a chunk is 128 of its positions.
CHUNK_ELEMENTS = 2**24


def chunked(fn: Callable, scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fn(scores [n, C] in float32, targets [n]) -> [n], over the rows of `scores` [N, C] (in any dtype) a chunk of
    rows (CHUNK_ELEMENTS scores) at a time: neither the float32 copy of the whole scores nor fn's intermediates over
    them exist at once. The result is fn's over the whole, [N] float32, fn working row by row."""
    rows = max(1, CHUNK_ELEMENTS // max(1, scores.shape[-1]))
    # Each chunk's float32 copy and intermediates are computed again in the backward, not kept for it: kept, they would
    # add up to the whole again. (A hand-written autograd Function writing each chunk's gradient into one buffer
    # peaked the same, within a chunk.) fn draws no random numbers: no RNG state to keep.
    return torch.cat([checkpoint(_in_float32, fn, s, t, use_reentrant=False, preserve_rng_state=False)
                      for s, t in zip(scores.split(rows), targets.split(rows))])


def _in_float32(fn: Callable, scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return fn(scores.float(), targets)


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


def _shape(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {list(obj.shape)}"
    return f"a {type(obj).__name__}"
