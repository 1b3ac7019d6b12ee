"""The first-sample check: before anything is written, two training samples pass through the collate and forward
functions, the model, the loss (and its backward pass) and the metrics, so that data that does not fit the model, or
outputs that do not fit the loss, are one line, not a traceback from inside the first training step. It finds how
the loss counts (a mean, or a sum over items), which parameters get no gradient, and, for packed sets, proves that
packed documents do not attend to each other (`check_attention`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader, IterableDataset, default_collate

from ..config import ConfigError, first_line
from ..data import streams
from ..data.datasets import IGNORE_INDEX, Heads, InMemory, one_at_a_time
from ..data.kinds import SetKind
from . import losses
from . import metrics as builtin_metrics
from .components import MISFITS, Workload


def first_samples(dataset, kind: SetKind, n: int, collate: Callable | None = None, heads: Heads | None = None):
    """The first `n` samples as one batch, collated as the training loader collates them (`kind`: the set's, from
    `Data.kind`; `heads`: the run's first samples of its streams, datasets.Heads)."""
    if kind.stream:
        return (collate or default_collate)(streams.first(dataset, n, heads=heads))
    if collate is not None:
        dataset = one_at_a_time(dataset)  # a collate function takes samples
    elif isinstance(dataset, InMemory):
        collate = InMemory.collate
    indices = [list(range(min(n, len(dataset))))]
    # A generator of its own: iterating a DataLoader otherwise draws from the global RNG.
    return next(iter(DataLoader(dataset, batch_sampler=indices, collate_fn=collate, generator=torch.Generator())))


@dataclass
class Checked:
    """What the first-sample check found: how the run computes its loss, and what it evaluates."""

    loss: Callable  # (outputs, targets) -> losses.Loss, or None when the outputs carry no loss
    fn: Callable | None  # the loss function `loss` calls (None: the model's own)
    loss_name: str
    metrics: dict[str, Callable]
    items: bool  # the loss is a sum over items (normalised by the global batch's count), not a mean
    loss_per: str  # "item" (a sum and a count), "sample" (a mean over samples), "position" (a mean over each
    # micro-batch's positions: tokens, pixels; exact only when every micro-batch has as many)
    item_scale: float  # items in one process's micro-batch, about: keeps the summed loss near a mean's size
    eval_loss: bool  # evaluation computes a loss (False: the model returns predictions in evaluation)
    unused: list[str]  # parameters that got no gradient from the first samples
    tables: dict  # name -> a metric with state whose result is a table (the confusion matrix), not a number


def check_fit(job: Workload, micro_batch: int = 2) -> Checked:
    """Passes two training samples through the forward, the loss (and its backward) in training mode,
    then the forward and the metrics in evaluation mode. Nothing of the model changes (its gradients,
    buffers and every random number generator are put back). Chooses the loss and metrics when the
    workload leaves them open, finds how the loss counts (a mean, or a sum over items) and which
    parameters get no gradient. A misfit is one line naming the pieces."""
    batch = _first_batch(job)
    model, was_training = job.model, job.model.training
    try:
        with torch.random.fork_rng(devices=[]), _model_kept(model):
            model.train()
            outputs, targets = _forward(job, batch)
            fn, loss_name, items = _choose_loss(job, batch, outputs, targets)
            loss = partial(losses.model_loss, items=items) if fn is None else fn
            value = _loss_value(loss, loss_name, job, outputs, targets)
            unused = _unused_parameters(model, value.value) if value.value.requires_grad else []
            model.eval()
            with torch.no_grad():
                outputs, targets = _forward(job, batch)
                eval_loss = _evaluates(loss, outputs, targets)
    finally:
        model.train(was_training)
    labels = isinstance(targets, torch.Tensor) and not targets.is_floating_point()
    metrics = job.metrics
    if metrics is None:  # accuracy for one class label per sample
        metrics = {"accuracy": builtin_metrics.accuracy} if labels and targets.dim() == 1 else {}
    metrics = {name: m.for_outputs(outputs, targets) if isinstance(m, type) else m for name, m in metrics.items()}
    _check_metrics(job, metrics, outputs, targets, eval_loss)
    if job.data.kind.packed:
        check_attention(model, job.collate, job.forward, job.data.train, job.model_name, job.data.heads)
    # A classification run also keeps its confusion matrix and per-class table (plots/confusion.png, summary.json).
    tables = {"confusion": builtin_metrics.Confusion.for_outputs(outputs, targets)} if labels and targets.dim() == 1 \
        and _class_scores(outputs) else {}
    count = float(value.items) if value.items is not None else 1.0
    loss_per = "item" if value.items is not None else "position" if labels and targets.dim() >= 2 else "sample"
    return Checked(loss, fn, loss_name, metrics, value.items is not None, loss_per, max(count, 1.0) * micro_batch / 2,
                   eval_loss, unused, tables)


OWN = "the model's own"


def _first_batch(job: Workload):
    try:
        return first_samples(job.data.train, job.data.kind.train, 2, job.collate, job.data.heads)
    except OSError as e:
        raise ConfigError(f"the first samples of {job.dataset_name} cannot be read ({type(e).__name__}: "
                          f"{first_line(e)}); acc-trainer check-data lists every unreadable sample") from None
    except MISFITS as e:
        how = f"the collate function {_name(job.collate)}" if job.collate else "the default collate (give a collate " \
            "function for samples of different sizes)"
        raise ConfigError(f"the samples of {job.dataset_name} cannot be batched by {how}: {type(e).__name__}: "
                          f"{first_line(e)}") from None


def _forward(job: Workload, batch) -> tuple[Any, Any]:
    call = job.forward or losses.forward
    try:
        result = call(job.model, batch)
    except ConfigError:  # the forward's own one line (an objective's: a reward function that fails)
        raise
    except MISFITS as e:
        how = f" through the forward function {_name(job.forward)}" if job.forward else ""
        raise ConfigError(f"model {job.model_name} does not take the samples of {job.dataset_name}{how} "
                          f"({describe(batch)}): {type(e).__name__}: {first_line(e)}") from None
    if job.forward and not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ConfigError(f"the forward function {_name(job.forward)} returned {describe(result)}; it must return "
                          "(outputs, targets)")
    return result


def _choose_loss(job: Workload, batch, outputs, targets) -> tuple[Callable | None, str, Callable | None]:
    """The loss function (None: the model's own), its name, and the model's own loss's item counter."""
    if job.loss is not None:
        return job.loss, job.loss_name or getattr(job.loss, "__name__", repr(job.loss)), None
    try:
        parts = losses.loss_parts(outputs)
    except ValueError as e:
        raise ConfigError(f"model {job.model_name}: {e}") from None
    own = losses.own_loss(outputs)
    if own is not None or parts:
        return None, OWN, losses.own_items(outputs, targets, own) if own is not None else None
    if isinstance(targets, torch.Tensor):
        fn = losses.cross_entropy if not targets.is_floating_point() else losses.mse
        return fn, fn.__name__, None
    raise ConfigError(f"no loss for {job.model_name} on {job.dataset_name}: its outputs carry no 'loss' and "
                      f"the batches have no target tensor ({describe(batch)}); give one with --loss / loss=")


def _loss_value(loss: Callable, loss_name: str, job: Workload, outputs, targets) -> losses.Loss:
    try:
        value = loss(outputs, targets)
        value = value if value is None or isinstance(value, losses.Loss) else losses.as_loss(value)
    except losses.NotALoss as e:
        raise ConfigError(f"loss {loss_name} returned {describe(e.value)}; it must return one number (a 0-dim tensor) "
                          "or a pair (sum, count)") from None
    except MISFITS as e:
        raise ConfigError(f"loss {loss_name} does not fit the outputs of {job.model_name} ({describe(outputs)}) and "
                          f"targets ({describe(targets)}): {type(e).__name__}: {first_line(e)}") from None
    if value is None:
        raise ConfigError(f"model {job.model_name} returned no loss in training ({describe(outputs)}); give a loss "
                          "function, or a forward function that passes the targets to the model")
    return value


def _evaluates(loss: Callable, outputs, targets) -> bool:
    """Whether the loss can be computed on the evaluation outputs (a detector returns predictions there)."""
    try:
        return loss(outputs, targets) is not None
    except MISFITS:
        return False


def _unused_parameters(model: nn.Module, loss: torch.Tensor) -> list[str]:
    """Names of the trainable parameters one backward pass leaves without a gradient."""
    loss.backward()
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


@contextmanager
def _model_kept(model: nn.Module):
    """The model's gradients and buffers (BatchNorm statistics) as they were, afterwards."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers() if not is_lazy(b)}
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in grads.items():
            p.grad = grad
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and b.shape == buffers[name].shape:
                    b.copy_(buffers[name])


def _check_metrics(job: Workload, metrics: dict, outputs, targets, job_has_loss: bool) -> None:
    size = len(targets) if isinstance(targets, (torch.Tensor, list, tuple)) and (
        not isinstance(targets, torch.Tensor) or targets.dim()) else None
    with torch.no_grad():
        for name, metric in metrics.items():
            if builtin_metrics.from_loss(metric):
                if not job_has_loss:
                    raise ConfigError(f"metric {name} is computed from the evaluation's loss, and {job.model_name}'s "
                                      "evaluation has none (a model that returns predictions without a loss)")
                continue
            try:
                if builtin_metrics.is_stateful(metric):  # updated once here, then reset
                    metric.update(outputs if isinstance(metric, builtin_metrics.Stateful) else metric_input(outputs),
                                  targets)
                    metric.reset()
                    continue
                value = metric(outputs, targets)
            except MISFITS as e:
                raise ConfigError(f"metric {name} does not fit the outputs of {job.model_name} ({describe(outputs)}): "
                                  f"{type(e).__name__}: {first_line(e)}") from None
            if not isinstance(value, torch.Tensor) or (value.dim() and size is not None and len(value) != size):
                raise ConfigError(f"metric {name} returned {describe(value)} for {size} samples; it must return one "
                                  "value per sample or one number")


def metric_input(outputs):
    """What a metric object (torchmetrics') is updated with: the predictions tensor when the outputs hold one
    (logits of an output object), else the outputs as they are (a detector's list of dicts)."""
    if isinstance(outputs, (torch.Tensor, list, tuple)):
        return outputs if not (isinstance(outputs, tuple) and outputs and isinstance(outputs[0], torch.Tensor)) \
            else outputs[0]
    try:
        return losses.predictions(outputs)
    except ValueError:
        return outputs


def _class_scores(outputs) -> bool:
    try:
        return losses.predictions(outputs).dim() == 2
    except ValueError:
        return False


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def describe(obj: Any) -> str:
    """Shapes and dtypes of a batch or outputs, for messages: `[2, 3, 32, 32] float32`."""
    if isinstance(obj, torch.Tensor):
        return f"{list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if isinstance(obj, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in obj) + ")"
    return type(obj).__name__


def check_attention(model, collate: Callable | None, forward: Callable | None, dataset, model_name: str,
                    heads: Heads | None = None) -> None:
    """For a packed set, proves on the model itself, through the run's collate and forward functions, that a
    document's outputs do not depend on the document before it in its block (raises ConfigError, one line,
    when they do, or when the model takes no position_ids); `dataset`: a packing.Packed set, or a PackedStream
    (its first block read through `heads`, the run's first samples of its streams). Two forward passes in evaluation
    mode, on the first tokens of the first block cut into two documents, the first of them changed in the second
    pass: with attention within each document the second document's logits are the same to the last bit (the other
    document's attention weights are exact zeros), else they move."""
    block = streams.first(dataset, 1, heads=heads)[0] if isinstance(dataset, IterableDataset) else dataset[0]
    tokens = block["input_ids"][:min(dataset.length, 32)]
    half = len(tokens) // 2
    first, second = tokens[:half], tokens[half:]
    other = next((c for c in (second[:half], first.flip(0), first.roll(1), torch.full_like(first, dataset.pad_id))
                  if len(c) == half and not torch.equal(c, first)), None)
    if half < 1 or other is None:
        return  # too few tokens, or all the same token: nothing to tell the documents apart by
    positions = torch.cat([torch.arange(half), torch.arange(len(second))])
    labels = tokens.clone()
    labels[[0, half]] = IGNORE_INDEX
    logits = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for before in (first, other):
                block = {"input_ids": torch.cat([before, second]), "labels": labels, "position_ids": positions}
                outputs, _ = (forward or losses.forward)(model, (collate or default_collate)([block]))
                logits.append(losses.predictions(outputs)[0, half:].float())
    except MISFITS as e:
        what = "does not take position_ids" if "position_ids" in str(e) else "does not take packed blocks"
        raise ConfigError(f"--pack: model {model_name} {what} ({type(e).__name__}: {first_line(e)}), so packed "
                          "documents cannot be kept apart; see docs/language-models.md#packing") from None
    finally:
        model.train(was_training)
    moved = float((logits[0] - logits[1]).abs().max())
    if not moved <= 1e-6 * max(1.0, float(logits[0].abs().max())):
        through = f" through the collate function {getattr(collate, '__name__', repr(collate))}" if collate else ""
        raise ConfigError(f"--pack: model {model_name} lets packed documents attend to each other{through} (a "
                          f"document's logits move by {moved:.2g} when the one before it in the block changes); "
                          "packing needs a model that starts a document where position_ids restart (transformers' "
                          "Llama, Mistral, Qwen, Gemma, Phi, GPT-2, GPT-NeoX, ...; not OPT, Falcon, Bloom or MPT) and "
                          "batches without an attention_mask: see docs/language-models.md#packing")
