"""The public API of training: `train(config)` trains what the options name (built-in names or import paths,
resolved in components.py); `fit(model, train_data, ...)` trains a user's own objects. Both end in the one
loop (loop.run).
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch
from accelerate.utils import set_seed

from ..config import ConfigError, TrainConfig, did_you_mean, make_config
from ..distributed import processes
from ..workload import components
from .loop import run


def train(cfg: TrainConfig) -> dict:
    """Train what `cfg` names; every process calls this. Returns the run summary (also in summary.json).

    Raises ConfigError for bad input and TrainingStopped when a signal or a NaN/inf loss stops the run.
    """
    cfg.validate()
    with _random_state_kept():
        _fresh_accelerator_state()
        group = processes.start(cfg)  # before the workload: a download happens on the main process first
        set_seed(cfg.seed)  # the same initial weights and generated data on every process
        return run(cfg, components.build_workload(cfg), group)


def fit(model, train_data, eval_data=None, *, loss=None, metrics=None, collate_fn=None, forward=None,
        optimizer=None, scheduler=None, tokenizer=None, config: TrainConfig | None = None, on_evaluation=None,
        **options) -> dict:
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
    transformers tokenizer (or what `--tokenizer` takes), saved with the weights and used for `prompts`.
    `on_evaluation(evaluation)`: called after each evaluation, on every process, with its results (`step`, `epoch`,
    `loss`, each metric), for pruning or logging of your own; an exception it raises (`optuna.TrialPruned`) ends the
    run and fit() raises it. `options` are TrainConfig fields (`epochs=3, batch_size=256, init_from="w.pt", ...`),
    applied over `config`. Every process of a launch calls this with the same arguments; returns the run summary.
    Python's, NumPy's and torch's global random states are the caller's again afterwards (the run draws from
    `seed`), and each run may take its own `mixed_precision`.
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
    # config.yaml names the loss and metrics given by name or import path, and `config=` gives them back (not a
    # function of the script itself, __main__, which no other process could import)
    loss_path = loss if isinstance(loss, str) else components.function_name(loss) if callable(loss) else None
    if loss_path and not loss_path.startswith("__main__:"):
        options.setdefault("loss", loss_path)
    if isinstance(metrics, (list, tuple)):
        options.setdefault("metrics", list(metrics))
    cfg = fit_config(model, train_data, config, options, collate_fn, forward)
    job = components.from_objects(model, train_data, eval_data, loss if loss is not None else cfg.loss,
                                  metrics if metrics is not None else cfg.metrics, collate_fn or cfg.collate,
                                  forward or cfg.forward, cfg.pack, cfg.data_pipeline)
    job.optimizer, job.scheduler = factories.get("optimizer"), factories.get("scheduler")
    job.tokenizer = tokenizer  # an object; one named by cfg.tokenizer is loaded by the loop (generation.ready)
    job.on_evaluation = on_evaluation
    given = {"loss": loss, "metrics": metrics, "collate_fn": collate_fn, "forward": forward, "optimizer": optimizer,
             "scheduler": scheduler, "tokenizer": tokenizer}
    job.unnamed = _unnamed(cfg, job, given)
    with _random_state_kept():
        _fresh_accelerator_state()
        return run(cfg, job)


def _unnamed(cfg: TrainConfig, job: components.Workload, given: dict) -> tuple[str, ...]:
    """What fit() was given that config.yaml cannot name (config.yaml's first line says it: RunFiles.write_config): the
    model and the data, and the functions and objects without an import path."""
    recorded = {"loss": cfg.loss, "metrics": cfg.metrics, "collate_fn": cfg.collate, "forward": cfg.forward}
    unnamed = [f"model {job.model_name}", f"data {job.dataset_name}"]
    for name, value in given.items():
        if value is None or isinstance(value, str) or recorded.get(name) is not None:
            continue
        label = ", ".join(value) if isinstance(value, dict) else getattr(value, "__name__", type(value).__name__)
        unnamed.append(f"{name} {label}")
    return tuple(unnamed)


@contextmanager
def _random_state_kept():
    """A run seeds the process's global generators (Python, NumPy, torch) from --seed: every process must draw the
    same dropout and augmentation. The caller's draws continue afterwards as if no run had happened."""
    cuda = torch.cuda.is_initialized()  # asking an uninitialised device for its state would start CUDA here
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda:
            torch.cuda.set_rng_state_all(saved[3])


def _fresh_accelerator_state() -> None:
    """Accelerate keeps one AcceleratorState per process (the precision, the compile and engine plugins) and refuses
    an Accelerator of another precision ("restart your runtime"): a run after another in this process starts from a
    new one. The process group (PartialState) stays. Private: Accelerate has no public reset, and its own tests
    reset it this way."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state:
        AcceleratorState._reset_state()


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
