"""The public API of training: `train(config)` trains what the options name (built-in names or import paths,
resolved in components.py); `fit(model, train_data, ...)` trains a user's own objects. Both end in the one
loop (loop.run). `find_lr` (fit's arguments) and `range_test` (train's, for `acc-trainer lr-find`) run the
learning-rate range test (lr_range.py) through the same loop, on a copy of the weights.
"""

from __future__ import annotations

import copy
import random
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import set_seed

from .. import objectives
from ..config import ConfigError, TrainConfig, did_you_mean, make_config
from ..data import mixtures
from ..distributed import processes
from ..outputs.runfiles import refuse_a_run_in, refuse_a_used_folder
from ..workload import components
from ..workload.models import accelerate_marks_undone
from . import lr_range
from .loop import run


def train(cfg: TrainConfig) -> dict:
    """Train what `cfg` names; every process calls this. Returns the run summary (also in summary.json).

    Raises ConfigError for bad input and TrainingStopped when a signal or a NaN/inf loss stops the run.
    """
    cfg.validate()
    with _random_state_kept():
        _fresh_accelerator_state()
        group = processes.start(cfg)  # before the workload: a download happens on the main process first
        refuse_a_used_folder(cfg)  # before the workload too: its data may take minutes to build
        set_seed(cfg.seed)  # the same initial weights and generated data on every process
        return run(cfg, components.build_workload(cfg), group)


def fit(model, train_data, eval_data=None, *, loss=None, metrics=None, collate_fn=None, forward=None,
        optimizer=None, scheduler=None, tokenizer=None, config: TrainConfig | None = None, on_evaluation=None,
        rewards=None, judge=None, **options) -> dict:
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
    `seed`), and each run may take its own `mixed_precision`. `lr="find"` runs find_lr first (its defaults, into
    `<output_dir>/lr-find` or runs/lr-find-...) and trains with its suggestion; resumed, with the one its lr-find/
    recorded.
    """
    if options.get("lr") == "find":
        options["lr"] = _found_lr(model, train_data, options, loss=loss, metrics=metrics, collate_fn=collate_fn,
                                  forward=forward, optimizer=optimizer, tokenizer=tokenizer, config=config)
    factories = _factories(optimizer, scheduler, options)
    if isinstance(tokenizer, str):
        options["tokenizer"], tokenizer = tokenizer, None
    if rewards is not None and all(isinstance(r, str) for r in rewards):  # import paths: config.yaml names them
        options["rewards"], rewards = list(rewards), None
    if judge is not None and all(isinstance(j, str) for j in judge):
        options["judge"], judge = list(judge), None
    # config.yaml names the loss and metrics given by name or import path, and `config=` gives them back (not a
    # function of the script itself, __main__, which no other process could import)
    loss_path = loss if isinstance(loss, str) else components.function_name(loss) if callable(loss) else None
    if loss_path and not loss_path.startswith("__main__:"):
        options.setdefault("loss", loss_path)
    if isinstance(metrics, (list, tuple)):
        options.setdefault("metrics", list(metrics))
    cfg = fit_config(model, train_data, config, options, collate_fn, forward)
    processes.start(cfg)  # the process group first: under a launcher the main process tokenizes text, the others read it
    job = components.from_objects(model, train_data, eval_data, loss if loss is not None else cfg.loss,
                                  metrics if metrics is not None else cfg.metrics, collate_fn or cfg.collate,
                                  forward or cfg.forward, cfg.pack, cfg.data_pipeline, cfg, tokenizer)
    job.optimizer, job.scheduler = factories.get("optimizer"), factories.get("scheduler")
    job.on_evaluation = on_evaluation
    job.objective = objectives.of(cfg, rewards, judge) if rewards is not None or judge is not None else None
    given = {"rewards": rewards, "judge": judge, "loss": loss, "metrics": metrics, "collate_fn": collate_fn, "forward": forward,
             "optimizer": optimizer, "scheduler": scheduler, "tokenizer": tokenizer}
    job.unnamed = _unnamed(cfg, job, given)
    with _random_state_kept(), accelerate_marks_undone(model):
        _fresh_accelerator_state()
        return run(cfg, job)


def find_lr(model, train_data, eval_data=None, *, min_lr: float = 1e-7, max_lr: float = 1.0, steps: int = 100,
            output_dir: str | None = None, optimizer=None, scheduler=None, config: TrainConfig | None = None,
            **fit_args) -> lr_range.RangeTest:
    """The learning-rate range test (lr_range.py) of what `fit(model, train_data, ..., **fit_args)` would train: `steps`
    optimizer steps of fit()'s own loop on a copy of `model`, the learning rate growing exponentially from `min_lr` to
    `max_lr`, each step's loss recorded. Returns a RangeTest: `suggestion` (the learning rate where the smoothed loss
    falls fastest), `lrs`, `losses`, `smoothed`, `stopped_at`, `folder` and `figure`. `model` keeps its weights and
    the global random states are the caller's again: fit(model, ..., lr=suggestion) afterwards trains exactly as it
    would have without the test. The test does not evaluate (`eval_data` is taken for fit's signature, and left
    out), and its schedule replaces `scheduler`. Its files go to `output_dir` (lr_find.json, lr_find.png and the
    run in run/), by default a new runs/lr-find-<time>-<model>-<dataset>. Raises ConfigError for bad input and
    when the loss diverges too soon to suggest a learning rate."""
    test = lr_range.RangeTest(min_lr, max_lr, steps)
    schedule = lr_range.Schedule(test)
    options = {k: v for k, v in fit_args.items() if k in TrainConfig.__dataclass_fields__ and k != "lr"}
    cfg = fit_config(model, train_data, config, options)
    processes.start(cfg)  # the process group: the main process names the folder for all
    folder = lr_range.folder_for(output_dir, cfg.model, mixtures.label(cfg.dataset))
    if callable(optimizer) and not isinstance(optimizer, (str, torch.optim.Optimizer)):
        optimizer = _starting_at(optimizer, min_lr)
    with lr_range.ending_where_not_finite(test):
        fit(copy.deepcopy(model), train_data, None, optimizer=optimizer, scheduler=schedule, config=config,
            **{**fit_args, **lr_range.run_options(test, folder)})
    title = " on ".join(name.rpartition(":")[2] for name in (cfg.model, mixtures.label(cfg.dataset)))
    return _concluded(test, folder, schedule, title)


def range_test(cfg: TrainConfig, min_lr: float = 1e-7, max_lr: float = 1.0, steps: int = 100) -> lr_range.RangeTest:
    """`acc-trainer lr-find`: find_lr on the workload `cfg` names, built as train() builds it, without its evaluation
    set; `cfg.output_dir` is the test's folder. Every process calls this."""
    test = lr_range.RangeTest(min_lr, max_lr, steps)
    schedule = lr_range.Schedule(test)
    with _random_state_kept():
        _fresh_accelerator_state()
        group = processes.start(cfg)
        folder = lr_range.folder_for(cfg.output_dir, cfg.model, mixtures.label(cfg.dataset))
        cfg = make_config({**cfg.to_dict(), **lr_range.run_options(test, folder), "scheduler": "constant"})
        set_seed(cfg.seed)
        job = components.build_workload(cfg)
        job.data = replace(job.data, eval=None, kind=replace(job.data.kind, eval=None))
        job.scheduler = schedule
        with lr_range.ending_where_not_finite(test):
            run(cfg, job, group)
    return _concluded(test, folder, schedule, f"{cfg.model} on {mixtures.label(cfg.dataset)}")


def _found_lr(model, train_data, options: dict, **fit_args) -> float:
    """fit(lr="find"): find_lr with fit's arguments (into the run's folder's lr-find/), its suggestion said."""
    from accelerate import PartialState

    if callable(fit_args["optimizer"]) and not isinstance(fit_args["optimizer"], str):
        raise ConfigError("fit: lr=\"find\" sets the run's lr, which an optimizer factory does not take (it names its "
                          "own): run find_lr(...) first and put its suggestion in the factory")
    rest = {k: v for k, v in options.items() if k not in ("lr", "output_dir")}
    config = fit_args["config"]
    run_folder = options.get("output_dir") or (config.output_dir if config else None)
    resume = options["resume"] if "resume" in options else config.resume if config else None
    recorded = Path(run_folder, "lr-find") if run_folder and resume is not None else None
    suggestion = processes.main_decides(lambda: lr_range.recorded_suggestion(recorded)) if recorded else None
    if suggestion is not None:  # a resumed run goes on with the rate it was started with
        if PartialState().is_main_process:
            print(f"lr=\"find\": resuming with the learning rate the run was started with, {suggestion:.1e} "
                  f"({recorded / 'lr_find.json'})")
        return suggestion
    if run_folder and resume is None:
        refuse_a_run_in(Path(run_folder))  # before the test: the run itself would be refused after it
    test = find_lr(model, train_data, output_dir=run_folder and f"{run_folder}/lr-find", **fit_args, **rest)
    if PartialState().is_main_process:
        print(f"lr=\"find\": suggested learning rate {test.suggestion:.1e} (steepest descent of the smoothed loss; "
              f"figure: {test.figure}); training with it")
    return test.suggestion


def _starting_at(factory, lr: float):
    """fit's optimizer factory, its groups' learning rate set to the test's first (a factory names its own)."""
    def build(groups):
        optimizer = factory(groups)
        for group in getattr(optimizer, "param_groups", []):
            group["lr"] = lr
        return optimizer

    return build


def _concluded(test: lr_range.RangeTest, folder, schedule: lr_range.Schedule, title: str) -> lr_range.RangeTest:
    """The test's curve and suggestion, made by the main process from its run's files and handed to every process;
    a curve too short to suggest from raises its ConfigError on each."""
    return processes.main_decides(lambda: lr_range.conclude(test, folder, schedule, title))


def _factories(optimizer, scheduler, options: dict) -> dict:
    """fit()'s optimizer= and scheduler=: a name goes to `options`, a factory is returned; an object is one line."""
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
    return factories


def _unnamed(cfg: TrainConfig, job: components.Workload, given: dict) -> tuple[str, ...]:
    """What fit() was given that config.yaml cannot name (config.yaml's first line says it: RunFiles.write_config): the
    model and the data, and the functions and objects without an import path."""
    recorded = {"loss": cfg.loss, "metrics": cfg.metrics, "collate_fn": cfg.collate, "forward": cfg.forward}
    unnamed = [f"model {job.model_name}", f"data {job.dataset_name}"]
    for name, value in given.items():
        if value is None or isinstance(value, str) or recorded.get(name) is not None:
            continue
        label = ", ".join(value) if isinstance(value, dict) else ", ".join(
            getattr(v, "__name__", type(v).__name__) for v in value) if isinstance(value, (list, tuple)) else \
            getattr(value, "__name__", type(value).__name__)
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
    if mixtures.is_mixture(train_data):  # [(dataset, weight), ...]: NAME=WEIGHT, as --dataset names a mixture's sets
        values["dataset"] = [f"{components.qualified_name(d)}={float(w)!r}" for d, w in train_data]
    for name, fn in (("collate", collate_fn), ("forward", forward)):
        if fn is not None:
            values[name] = fn if isinstance(fn, str) else components.function_name(fn)
    return make_config(values)
