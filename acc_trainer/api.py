"""The public API of training: `train(config)` trains what the options name (built-in names or import paths,
resolved in components.py); `fit(model, train_data, ...)` trains a user's own objects. Both end in the one
loop (loop.run).
"""

from __future__ import annotations

import torch
from accelerate.utils import set_seed

from . import components, processes
from .config import ConfigError, TrainConfig, did_you_mean, make_config
from .loop import run


def train(cfg: TrainConfig) -> dict:
    """Train what `cfg` names; every process calls this. Returns the run summary (also in summary.json).

    Raises ConfigError for bad input and TrainingStopped when a signal or a NaN/inf loss stops the run.
    """
    cfg.validate()
    group = processes.start(cfg)  # before the workload: a download happens on the main process first
    set_seed(cfg.seed)  # the same initial weights and generated data on every process
    return run(cfg, components.build_workload(cfg), group)


def fit(model, train_data, eval_data=None, *, loss=None, metrics=None, collate_fn=None, forward=None,
        optimizer=None, scheduler=None, tokenizer=None, config: TrainConfig | None = None, **options) -> dict:
    """Train `model` (a plain nn.Module) on `train_data`, evaluating on `eval_data` after every epoch (or every
    `eval_every` steps).

    Datasets are map-style and yield `(inputs, targets)` or dicts of tensors (the model is then
    called as `model(**batch)`, targets are `batch["labels"]`). `loss`: a function
    `loss(outputs, targets) -> scalar` or a built-in name; None uses the model's own loss when its
    outputs carry one, else cross-entropy for integer targets and MSE for real ones; a loss may return
    `(sum, count)` over items (tokens, boxes), normalised over the whole global batch (losses.py).
    `metrics`: a dict of name -> `metric(outputs, targets)` (one value per sample) or built-in names.
    `collate_fn(samples) -> batch` batches samples of different sizes; `forward(model, batch) ->
    (outputs, targets)` replaces the default model call (or "with_targets"). `optimizer`: a name or
    `factory(param_groups) -> Optimizer`; `scheduler`: a name or `factory(optimizer, total_steps)`. `tokenizer`: a
    transformers tokenizer (or what `--tokenizer` takes), saved with the weights and used for `prompts`. `options`
    are TrainConfig fields (`epochs=3, batch_size=256, init_from="w.pt", ...`), applied over `config`. Every
    process of a launch calls this with the same arguments; returns the run summary.
    """
    factories = {}
    for name, given, kind in (("optimizer", optimizer, torch.optim.Optimizer),
                              ("scheduler", scheduler, torch.optim.lr_scheduler.LRScheduler)):
        if isinstance(given, kind):
            factory = "factory(param_groups)" if name == "optimizer" else "factory(optimizer, total_steps)"
            raise ConfigError(f"fit: {name}= takes a name or a {factory}, "
                              f"not a {type(given).__name__} object: the trainer builds the parameter groups")
        if isinstance(given, str):
            options[name] = given
        elif given is not None:
            factories[name] = components._callable(given, repr(given), f"fit: {name}")
    if isinstance(tokenizer, str):
        options["tokenizer"], tokenizer = tokenizer, None
    cfg = fit_config(model, train_data, config, options, collate_fn, forward)
    job = components.from_objects(model, train_data, eval_data, loss, metrics, collate_fn or cfg.collate,
                                  forward or cfg.forward, cfg.pack)
    job.optimizer, job.scheduler = factories.get("optimizer"), factories.get("scheduler")
    job.tokenizer = tokenizer  # an object; one named by cfg.tokenizer is loaded by the loop (generation.ready)
    return run(cfg, job)


def fit_config(model, train_data, config: TrainConfig | None, options: dict, collate_fn=None,
               forward=None) -> TrainConfig:
    """`config` with `options` over it, naming the model and data by their classes (and the collate and
    forward functions by their import paths, when they have one)."""
    values = config.to_dict() if config is not None else {}
    unknown = sorted(set(options) - set(TrainConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"fit: unknown option {unknown[0]!r} (options are TrainConfig fields, e.g. epochs, batch_size)"
                          + did_you_mean(unknown[0], TrainConfig.__dataclass_fields__))
    values.update(options)
    values["model"], values["dataset"] = components.qualified_name(model), components.qualified_name(train_data)
    for name, fn in (("collate", collate_fn), ("forward", forward)):
        if fn is not None:
            values[name] = fn if isinstance(fn, str) else components.function_name(fn)
    return make_config(values)
