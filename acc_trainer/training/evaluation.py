"""Evaluation, exactly: every sample counted once whatever the number of processes. The one path for the
training run's evaluations and for `evaluate` / `predict` on a finished model (inference.py).

Accelerate pads the last batch so that every process gets as many samples; `gather_for_metrics` drops that
padding, so gathering each process's own index through it says how many of its samples are real
(`real_batches`). Only those pass through the model's results: a batch of a user's collate function (or a
stream's share) is collated once the real samples are known, unreadable samples are reported by index,
and every process still makes one model call per batch, as FSDP needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import find_batch_size, gather_object, recursively_apply, send_to_device

from .. import patches
from ..data.datasets import Uncollated
from ..data.faults import unreadable_everywhere
from ..outputs.progress import format_metric
from ..workload.first_batch import metric_input
from ..workload.losses import batch_loss, model_inputs
from ..workload.metrics import Stateful, from_loss, is_stateful


def real_batches(accelerator: Accelerator, loader, guarded: bool) -> Iterator[tuple]:
    """Each batch of an evaluation loader as `(batch, real, unreadable)`: the batch cut to this process's
    `real` samples (at least one: every process calls the model), and the indices of those that could not
    be read (faults.Guarded batches carry them)."""
    for batch in loader:
        indices = None
        if isinstance(batch, Uncollated):  # a user's collate function (or a stream): collated once the real samples are known
            real = batch.real if batch.real is not None else real_samples(accelerator, len(batch))
            batch = send_to_device(batch.first(max(real, 1)), accelerator.device, non_blocking=True)
            if guarded:
                batch, indices = batch
        else:
            if guarded:
                batch, indices = batch
            size = find_batch_size(batch)
            real = real_samples(accelerator, size)
            if real < size:
                batch = recursively_apply(lambda t: t[: max(real, 1)], batch)
        yield batch, real, [int(i) for i in indices[:real] if i >= 0] if guarded else []


def real_samples(accelerator: Accelerator, size: int) -> int:
    """How many of this process's `size` samples are real (not Accelerate's padding of the last batch)."""
    if not accelerator.gradient_state.end_of_dataloader:
        return size  # only the last batch is padded
    owner = torch.full((size,), accelerator.process_index, device=accelerator.device)
    return int((accelerator.gather_for_metrics(owner) == accelerator.process_index).sum())


def everyones(accelerator: Accelerator, values, real: int, even: bool = False):
    """The first `real` values of this batch (a tensor, or a list or dict of them) of every process, in process
    order, on every process: the whole global batch's real samples, in the dataset's order. `even`: every
    process holds as many (a batch before a loader's last), so a tensor needs one gather."""
    mine = _first(values, real)
    if accelerator.num_processes == 1:
        return mine
    if isinstance(mine, torch.Tensor) and mine.dim() and even:
        return accelerator.gather(mine.contiguous().to(accelerator.device))
    if isinstance(mine, torch.Tensor) and mine.dim():  # padded to the longest share, then cut back
        lengths = accelerator.gather(torch.tensor([len(mine)], device=accelerator.device)).tolist()
        padded = accelerator.pad_across_processes(mine.contiguous().to(accelerator.device), dim=0)
        everything, size = accelerator.gather(padded), padded.shape[0]
        return torch.cat([everything[i * size: i * size + n] for i, n in enumerate(lengths)])
    parts = gather_object([send_to_device(mine, "cpu")])
    return send_to_device(_joined(parts), accelerator.device)


def _everyones_pair(accelerator: Accelerator, predictions, targets, real: int) -> tuple:
    """`everyones` of predictions and targets at once (one gather), for metric objects, which then need no
    distributed code of their own."""
    mine = (_first(predictions, real), _first(targets, real))
    if accelerator.num_processes == 1:
        return mine
    parts = gather_object([send_to_device(mine, "cpu")])
    return tuple(send_to_device(_joined([part[i] for part in parts]), accelerator.device) for i in (0, 1))


def evaluate(accelerator: Accelerator, model, loader, loss_fn, metrics: dict, channels_last: bool = False,
             input_dtype: torch.dtype | None = None, guarded: bool = False, forward_fn: Callable | None = None,
             tables: dict | None = None, watch=None) -> dict:
    """The loss and every metric over the whole evaluation set, each sample counted once whatever the
    number of processes, and nothing but running sums kept (never the whole set's outputs).

    Each batch's loss and per-sample metrics are weighted by its real samples; a loss summed over items
    (tokens) is divided by the items of the whole set. A loss the outputs do not carry (a model that returns
    predictions in evaluation) is left out of the results. Metrics with state (F1, AUROC, mAP; metrics.py)
    are updated with the real samples only and computed once, over every process (`merged_metric`);
    `tables` (the confusion matrix) come back under "tables". With `guarded` batches the indices of
    samples that could not be read come back as `unreadable` (on every process). `watch` (a training run's
    watchdog) is told of every batch.
    """
    model.eval()
    stateful = {name: m for name, m in {**metrics, **(tables or {})}.items() if is_stateful(m)}
    derived = {name: m for name, m in metrics.items() if from_loss(m)}  # perplexity: of the final loss
    metrics = {name: m for name, m in metrics.items() if name not in stateful and name not in derived}
    builtin = {name: m for name, m in stateful.items() if isinstance(m, Stateful)}
    objects = {name: m for name, m in stateful.items() if name not in builtin}  # torchmetrics' and the like
    for metric in stateful.values():
        metric.reset()
        if hasattr(metric, "to") and metric in objects.values():  # a torchmetrics object: where the outputs are
            metric.to(accelerator.device)
    # loss total, loss count (items or samples), each metric's total, samples
    totals = torch.zeros(len(metrics) + 3, dtype=torch.float64, device=accelerator.device)
    unreadable, has_loss = [], True
    with torch.no_grad():
        for batch, real, bad in real_batches(accelerator, loader, guarded):
            if watch is not None:
                watch.at("evaluation")
            unreadable += bad
            batch = model_inputs(batch, channels_last, input_dtype)
            outputs, targets, loss = batch_loss(model, batch, loss_fn, forward_fn)
            has_loss = has_loss and loss is not None  # the same on every process: each calls the model
            if objects:  # every process's real samples, to every process (a collective: before the skip below)
                shared = _everyones_pair(accelerator, metric_input(outputs), targets, real)
                for metric in objects.values():
                    metric.update(*shared)
            if real == 0:
                continue
            loss_total = [totals.new_zeros(()), totals.new_zeros(())]
            if has_loss:
                loss_total = [loss.value.detach().double(), loss.items.double()] if loss.items is not None else [
                    _sample_sum(loss.value, real), totals.new_tensor(real)]
            values = [_sample_sum(metric(outputs, targets), real) for metric in metrics.values()]
            totals += torch.stack([*loss_total, *values, totals.new_tensor(real)])
            for metric in builtin.values():
                metric.update(outputs, targets)
    model.train()
    results = _results(accelerator, accelerator.reduce(totals, "sum").tolist(), has_loss, metrics, derived, stateful,
                       tables or {})
    if guarded:
        results["unreadable"] = unreadable_everywhere(accelerator, unreadable)
    return results


def _results(accelerator: Accelerator, totals: list[float], has_loss: bool, metrics: dict, derived: dict,
             stateful: dict, tables: dict) -> dict:
    """The evaluation's figures from the sums over every process (loss total, loss count, each per-sample metric's
    total, samples), the metrics derived from the loss, and the metrics with state computed over every process."""
    count = int(totals[-1])
    results = {"loss": totals[0] / max(totals[1], 1)} if has_loss else {}
    results.update({name: total / count for name, total in zip(metrics, totals[2:-1], strict=True)})
    results.update({name: fn(results["loss"]) for name, fn in derived.items() if has_loss})
    for name, metric in stateful.items():
        value = merged_metric(accelerator, metric)
        if name in tables:
            results.setdefault("tables", {}).update(value)
        else:
            results.update(_as_numbers(name, value))
    results["samples"] = count
    return results


def merged_metric(accelerator: Accelerator, metric):
    """A metric with state, computed over every process: a built-in's counts summed (one all-reduce) and
    its per-sample rows gathered, exactly the real samples of each process; an object of another kind
    (torchmetrics') combines the processes itself in `compute`, which every process calls."""
    if not isinstance(metric, Stateful):
        # Every process updated it with every process's real samples (`everyones`), so it must not gather them
        # again: torchmetrics' own synchronisation is turned off (its list states, mAP's, would need as many
        # updates on every process, which an exact evaluation cannot give: the last batch's real samples are
        # not spread evenly).
        with patches.unsynced(metric):
            return metric.compute()
    several = accelerator.num_processes > 1
    sums = accelerator.reduce(metric.sums.to(accelerator.device), "sum").cpu() if several else metric.sums.cpu()
    rows = None
    if metric.width:
        local = torch.cat(metric.rows) if metric.rows else torch.zeros(0, metric.width, dtype=torch.float64)
        rows = everyones(accelerator, local, len(local)).cpu()
    return metric.compute(sums, rows)


def _first(values, n: int):
    if isinstance(values, torch.Tensor) and values.dim() or isinstance(values, (list, tuple)):
        return values[:n]
    if isinstance(values, Mapping):
        return {k: _first(v, n) for k, v in values.items()}
    return values


def _joined(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if isinstance(first, Mapping):
        return {k: _joined([p[k] for p in parts]) for k in first}
    return [item for part in parts for item in part]


def _as_numbers(name: str, value) -> dict:
    """A metric's result as named numbers: one number, or each number of a dict (torchmetrics' mAP gives map,
    map_50, ...: kept by their own names when they start with the metric's, else as name_key)."""
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point() or isinstance(v, float):
                out[key if key.startswith(name) else f"{name}_{key}"] = float(v)
        return out
    return {name: float(value)}


def _sample_sum(value: torch.Tensor, samples: int) -> torch.Tensor:
    """A batch's total over its samples: a scalar is the batch's mean, a vector holds one value per sample."""
    value = value.detach().double()
    return value * samples if value.dim() == 0 else value.reshape(samples, -1).mean(dim=1).sum()


def format_results(metrics: dict) -> str:
    """An evaluation's results in one line."""
    parts = [f"eval loss {metrics['loss']:.4f}"] if "loss" in metrics else ["eval"]
    parts += [format_metric(name, value) for name, value in metrics.items()
              if name not in ("loss", "samples", "step", "epoch")]
    return ", ".join(parts) + f" on {metrics['samples']} samples"
