"""The one place where names become objects: a run's model, data, loss and metrics.

`--model`, `--dataset`, `--loss` and `--metrics` take a built-in name (the registries: data.DATASETS,
models.MODELS, losses.LOSSES, metrics.METRICS), `torchvision:<name>` / `timm:<name>` for models, or an
import path `pkg.module:attr` (a module in the current folder works too). Every process resolves the
same strings itself, so nothing is pickled. `fit()` hands objects directly; both end in a `Workload`,
the only thing the training loop takes.

Factories are called with `--model-args` / `--dataset-args` as keyword arguments, plus what the run
knows, for each parameter the factory declares and the arguments do not set: a model factory gets
`num_classes`, `input_shape` and `data` (the `Data` of the run); a dataset factory gets `seed` and
`config` (the `TrainConfig`). The built-in factories take `data` and `config` this way.

Before anything is written, `check_fit` passes one sample through the model, the loss and the metrics,
so that data that does not fit the model, or outputs that do not fit the loss, are one line, not a
traceback from inside the first training step.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader, default_collate

from ..config import IMPORT_PATH, ConfigError, TrainConfig, first_line
from ..data import packing, streams
from ..data.datasets import DATASETS, Data, Heads, InMemory, RawImages, check_data, is_stream, one_at_a_time, torchvision
from . import losses
from . import metrics as builtin_metrics
from .models import MODELS

# Exceptions that mean "these pieces do not fit together" when one sample passes through them; others
# (NameError, ZeroDivisionError, ...) are bugs in the user's code and keep their traceback.
MISFITS = (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError, NotImplementedError)


@dataclass
class Workload:
    """What the training loop trains: objects, already built. `loss`/`metrics` None: chosen by
    `check_fit` from the model's outputs and the data's targets."""

    model: nn.Module
    data: Data
    loss: Callable | None
    metrics: dict[str, Callable] | None
    model_name: str
    dataset_name: str
    loss_name: str | None = None
    collate: Callable | None = None  # list of samples -> batch; None: torch's default_collate
    forward: Callable | None = None  # (model, batch) -> (outputs, targets); None: losses.forward
    optimizer: Callable | None = None  # factory(param_groups) -> Optimizer (fit); None: --optimizer
    scheduler: Callable | None = None  # factory(optimizer, total_steps) -> scheduler (fit); None: --scheduler
    objects: bool = False  # given as objects (fit): model_name and dataset_name are their classes, not factories
    tokenizer: Any = None  # --tokenizer's (or fit's): saved with the weights, used for --prompts (generation.py)
    on_evaluation: Callable | None = None  # fit's: called with each evaluation (loop.keep_evaluation)


def import_object(path: str, what: str) -> Any:
    """`pkg.module:attr.sub` -> the object. The current folder is importable, as with `python -m`."""
    module_name, _, attr = path.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script's sys.path lacks it
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ConfigError(f"{what} {path}: no module named {e.name!r} (looked in {os.getcwd()} and the installed "
                              "packages)") from None
        raise ConfigError(f"{what} {path}: importing {module_name} failed: {type(e).__name__}: {first_line(e)}") from None
    except (ImportError, SyntaxError) as e:
        raise ConfigError(f"{what} {path}: importing {module_name} failed: {type(e).__name__}: {first_line(e)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {path}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def call_factory(factory: Callable, args: dict, known: dict, what: str) -> Any:
    """factory(**args, plus the `known` values its signature asks for); its failure is one line."""
    kwargs = dict(args)
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins and C types have no signature
        parameters = {}
    for name, value in known.items():
        if name in parameters and name not in kwargs and value is not None:
            kwargs[name] = value
    shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
    try:
        return factory(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{what}({shown}) raised {type(e).__name__}: {first_line(e)}") from None


# ---------------------------------------------------------------------------------------- from names


def build_workload(cfg: TrainConfig) -> Workload:
    """Everything `cfg` names, built in this process (every process calls this after seeding)."""
    from accelerate import PartialState

    # The main process builds the data first (and downloads, if it must); the others then read its
    # files. An error is raised only after the context, so that no process is left at its barrier.
    error = None
    with PartialState().main_process_first():
        try:
            data = build_data(cfg)
        except ConfigError as e:
            error = e
    if error is not None:
        raise error
    model = build_model(cfg, data)
    loss = build_loss(cfg.loss) if cfg.loss else None
    metrics = build_metrics(cfg.metrics) if cfg.metrics is not None else None
    return Workload(model, data, loss, metrics, cfg.model, cfg.dataset, cfg.loss, *build_batching(cfg.collate, cfg.forward))


def build_batching(collate, forward) -> tuple[Callable | None, Callable | None]:
    """The collate and forward functions: objects, import paths, or a built-in forward's name."""
    if isinstance(collate, str):
        collate = _callable(import_object(collate, "--collate"), collate, "--collate")
    elif collate is not None:
        collate = _callable(collate, repr(collate), "fit: collate_fn")
    if isinstance(forward, str):
        forward = losses.FORWARDS[forward] if forward in losses.FORWARDS else _callable(
            import_object(forward, "--forward"), forward, "--forward")
    elif forward is not None:
        forward = _callable(forward, repr(forward), "fit: forward")
    return collate, None if forward is losses.forward else forward


def build_data(cfg: TrainConfig) -> Data:
    spec, args = cfg.dataset, cfg.dataset_args or {}
    known = {"config": cfg, "seed": cfg.seed}
    if spec in DATASETS:
        data = call_factory(DATASETS[spec], args, known, f"dataset {spec}")
    else:
        factory = import_object(spec, "--dataset")
        made = call_factory(factory, args, known, f"dataset factory {spec}")
        if isinstance(made, Data):
            data = made
        elif isinstance(made, (tuple, list)) and len(made) == 2:
            data = data_from(*packing.pack_sets(made[0], made[1], cfg.pack, spec), spec)
        else:
            raise ConfigError(f"dataset factory {spec} returned {type(made).__name__}; it must return a pair "
                              "(train_dataset, eval_dataset)")
    if cfg.pack and not isinstance(data.train, packing.Packed):  # a built-in set: refused there, naming its samples
        data = data_from(*packing.pack_sets(data.train, data.eval, cfg.pack, spec), spec)
    check_data(data, cfg.batch_size, spec)
    return data


def build_model(cfg: TrainConfig, data: Data) -> nn.Module:
    spec, args = cfg.model, dict(cfg.model_args or {})
    known = {"num_classes": data.num_classes, "input_shape": data.input_shape, "data": data}
    if spec in MODELS and not cfg.pretrained:
        model = call_factory(MODELS[spec], args, known, f"model {spec}")
    elif spec.startswith("torchvision:"):
        model = _zoo_model(spec, args, data, _torchvision_models(cfg.pretrained), cfg.pretrained)
    elif spec.startswith("timm:"):
        model = _zoo_model(spec, args, data, _timm_models(cfg.pretrained), cfg.pretrained)
    elif cfg.pretrained:
        raise ConfigError(f"--pretrained applies to torchvision:<name> and timm:<name> models; for {spec}, load your "
                          "weights with --init-from FILE")
    else:
        model = call_factory(import_object(spec, "--model"), args, known, f"model factory {spec}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory {spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _torchvision_models(pretrained: bool = False) -> tuple[Callable, list[str]]:
    models = torchvision().models

    def create(name: str, num_classes: int | None = None, **kw):
        if not pretrained:
            return models.get_model(name, weights=None, **({"num_classes": num_classes} if num_classes else {}), **kw)
        # The weights fix the head's size (1000 ImageNet classes): built with it, then given a fresh head.
        return _new_head(models.get_model(name, weights="DEFAULT", **kw), num_classes)

    return create, models.list_models(module=models)


def _timm_models(pretrained: bool = False) -> tuple[Callable, list[str]]:
    if importlib.util.find_spec("timm") is None:
        raise ConfigError('timm models need the timm package: pip install "acc_trainer[timm]" (or pip install timm)')
    import timm

    return (lambda name, **kw: timm.create_model(name, pretrained=pretrained, **kw)), timm.list_models()


def _zoo_model(spec: str, args: dict, data: Data, zoo: tuple[Callable, list[str]], pretrained: bool = False) -> nn.Module:
    create, names = zoo
    library, _, name = spec.partition(":")
    if name not in names:
        close = [n for n in names if name.split("_")[0] in n][:8]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"--model {spec}: {library} has no classification model {name!r}{hint}")
    if "num_classes" not in args:
        if data.num_classes is None:
            raise ConfigError(f"--model {spec} needs num_classes: the dataset does not say how many classes it has; "
                              "set it with --model-args '{num_classes: N}'")
        args["num_classes"] = data.num_classes
    if not pretrained:
        return call_factory(lambda **kw: create(name, **kw), args, {}, f"{spec}")
    from accelerate import PartialState

    # The main process downloads the weights (once, into the cache) while the others wait, then they read them;
    # an error is raised after the context, so that no process is left at its barrier.
    error = None
    with PartialState().main_process_first():
        try:
            model = create(name, **args)
        except Exception as e:  # noqa: BLE001 - reported below in one line
            error = e
    if isinstance(error, OSError):  # URLError, HTTPError, a file that is not there
        raise ConfigError(_offline(spec, library, name, error)) from None
    if error is not None:
        shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"{spec}({shown}) raised {type(error).__name__}: {first_line(error)}") from None
    return model


def _new_head(model: nn.Module, num_classes: int | None) -> nn.Module:
    """The model with its last Linear layer (torchvision's classifiers' head) made for `num_classes`."""
    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if num_classes is None or not heads or heads[-1][1].out_features == num_classes:
        return model
    path, old = heads[-1]
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    setattr(parent, path.rpartition(".")[2], nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
    return model


def _offline(spec: str, library: str, name: str, error: Exception) -> str:
    """Where to put the pretrained weights when they cannot be downloaded."""
    if library == "torchvision":
        import torch.hub

        url = torchvision().models.get_model_weights(name).DEFAULT.url
        return (f"--pretrained: the weights of {spec} cannot be downloaded ({type(error).__name__}: {first_line(error)}); "
                f"put {url.rpartition('/')[2]} (from {url}) in {Path(torch.hub.get_dir()) / 'checkpoints'}, or give "
                "--init-from FILE")
    return (f"--pretrained: timm cannot load the weights of {name} ({type(error).__name__}: {first_line(error)}); with no "
            "network, put them in the Hugging Face cache (HF_HOME) or give --init-from FILE")


def build_loss(spec: str) -> Callable:
    if spec in losses.LOSSES:
        return losses.LOSSES[spec]
    if ":" not in spec:
        raise ConfigError(f"unknown loss {spec!r}; choose from {', '.join(losses.LOSSES)}, or give an import path "
                          "pkg.module:function")
    return _callable(import_object(spec, "--loss"), spec, "--loss")


def build_metrics(specs: list[str]) -> dict[str, Callable]:
    metrics = {}
    for spec in specs:
        if spec in builtin_metrics.METRICS:
            metrics[spec] = builtin_metrics.METRICS[spec]
        elif spec in builtin_metrics.FROM_LOSS:
            metrics[spec] = builtin_metrics.FROM_LOSS[spec]
        elif spec in builtin_metrics.STATEFUL:
            metrics[spec] = builtin_metrics.STATEFUL[spec]  # a class: built for the outputs by check_fit
        elif ":" in spec:
            metrics[spec.rpartition(":")[2].rpartition(".")[2]] = _metric(import_object(spec, "--metrics"), spec,
                                                                        "--metrics")
        else:
            names = [*builtin_metrics.METRICS, *builtin_metrics.STATEFUL, *builtin_metrics.FROM_LOSS]
            raise ConfigError(f"unknown metric {spec!r}; choose from {', '.join(names)}, or give an import path "
                              "pkg.module:function (or an object with update, compute and reset)")
    return metrics


def _metric(obj: Any, spec: str, what: str):
    """A metric: a function of (outputs, targets), or an object with update, compute and reset."""
    if builtin_metrics.is_stateful(obj):
        return obj
    if any(hasattr(obj, name) for name in ("update", "compute")) and not callable(obj):
        raise ConfigError(f"{what} {spec} is a {type(obj).__name__} without update, compute and reset; a metric is a "
                          "function metric(outputs, targets) or an object with all three")
    if not callable(obj):
        raise ConfigError(f"{what} {spec} is a {type(obj).__name__}, not a function metric(outputs, targets) or an "
                          "object with update, compute and reset")
    return obj


def _callable(obj: Any, spec: str, what: str) -> Callable:
    if not callable(obj):
        raise ConfigError(f"{what} {spec} is a {type(obj).__name__}, not a function")
    return obj


# -------------------------------------------------------------------------------------- from objects


def from_objects(model: nn.Module, train_data, eval_data, loss, metrics, collate=None, forward=None,
                 pack: int | None = None) -> Workload:
    """`fit()`'s arguments as a Workload: the same checks the command line's objects get (`pack`: --pack)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fit: model must be a torch.nn.Module, not {type(model).__name__}")
    name = type(train_data).__name__
    data = data_from(*packing.pack_sets(train_data, eval_data, pack, name), name)
    loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", None)
    if isinstance(loss, str):
        loss = build_loss(loss)
    elif loss is not None:
        loss = _callable(loss, repr(loss), "fit: loss")
    if isinstance(metrics, (list, tuple)):
        metrics = build_metrics(list(metrics))
    elif isinstance(metrics, Mapping):  # name -> a function, or a built-in name / import path
        metrics = {name: _metric(m, name, "fit: metric") if not isinstance(m, str)
                   else next(iter(build_metrics([m]).values())) for name, m in metrics.items()}
    elif metrics is not None:
        raise ConfigError(f"fit: metrics must be a dict of name -> metric or a list of names, not {type(metrics).__name__}")
    return Workload(model, data, loss, metrics, qualified_name(model), qualified_name(train_data), loss_name,
                    *build_batching(collate, forward), objects=True)


def qualified_name(obj: Any) -> str:
    """`module:Class` of an object: how a run made by fit() names its model and data."""
    kind = type(obj)
    name = kind.__qualname__ if "<" not in kind.__qualname__ else kind.__name__  # a class made inside a function
    return f"{kind.__module__}:{name}"


def function_name(fn: Callable) -> str | None:
    """`module:function` of a function defined at a module's top level (what config.yaml records), else None."""
    name = f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}"
    return name if IMPORT_PATH.match(name) else None


def data_from(train, eval_, name: str) -> Data:
    """A user's datasets as `Data`: the task and the number of classes are read off the samples."""
    for split, dataset in (("training", train), ("evaluation", eval_)):
        if dataset is not None and not is_stream(dataset) and not (hasattr(dataset, "__getitem__")
                                                                  and hasattr(dataset, "__len__")):
            raise ConfigError(f"the {split} data of {name} is a {type(dataset).__name__}, neither a map-style Dataset "
                              "(__getitem__ and __len__) nor an iterable one (__iter__)")
        if is_stream(dataset) and hasattr(type(dataset), "__next__"):  # a generator, a cursor: read once, then empty
            raise ConfigError(f"the {split} data of {name} is an iterator ({type(dataset).__name__}), which can be read "
                              "only once (the checks at start, every epoch and a resume read it again): give an object "
                              "whose __iter__ starts it anew, such as an IterableDataset whose __iter__ is a generator")
    heads = Heads()
    if is_stream(train):
        try:
            head = streams.first(train, 1, heads=heads)
        except Exception as e:
            if not streams.is_read_error(e):
                raise  # a bug in the stream's code: its traceback is the user's
            raise ConfigError(f"the training stream of {name} cannot be read ({streams.describe_error(e, [])})") from None
        if not head:
            raise ConfigError(f"the training stream of {name} is empty")
        sample = head[0]
    else:
        if len(train) == 0:
            raise ConfigError(f"the training set of {name} is empty")
        sample = train[0]
    if isinstance(sample, Mapping):
        inputs, targets = None, sample.get("labels")
    elif isinstance(sample, (tuple, list)) and len(sample) == 2:
        inputs, targets = sample
    else:
        raise ConfigError(f"samples of {name} must be (inputs, targets) pairs or dicts of tensors, "
                          f"not {type(sample).__name__}")
    targets = torch.as_tensor(targets) if isinstance(targets, (int, float)) else targets
    task, num_classes, notes = None, None, []
    if isinstance(targets, torch.Tensor):
        task = "regression" if targets.is_floating_point() else "classification"
        if task == "classification" and targets.dim() == 0:  # one class label per sample
            num_classes, notes = _checked_classes(train, eval_, name)
        elif task == "classification":
            num_classes = _num_classes(train)
    shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else None
    images = shape is not None and len(shape) == 3 and isinstance(targets, torch.Tensor) and not is_stream(train)
    return Data(train, eval_, task, num_classes, shape, RawImages(train, None) if images else None, heads, notes)


def _checked_classes(train, eval_, name: str) -> tuple[int | None, list[str]]:
    """The number of classes of a labelled set, with its labels checked where the datasets hold them (`targets`,
    a TensorDataset's last tensor): a negative label, or one at or past a declared number of classes, is one line
    instead of an IndexError inside the loss at some later step; a count inferred from the largest label while
    fewer distinct labels appear (a stray label making a larger head) gets a note."""
    num_classes = _num_classes(train)
    declared = _declared_classes(train)
    notes = []
    for split, dataset in (("training", train), ("evaluation", eval_)):
        labels = _labels(dataset) if dataset is not None else None
        if labels is None or not len(labels):
            continue
        low, high = int(labels.min()), int(labels.max())
        if low < 0:
            raise ConfigError(f"the {split} labels of {name} include {low} (sample {int((labels == low).nonzero()[0])}): "
                              "class labels run from 0 to the number of classes - 1")
        if num_classes is not None and high >= num_classes:
            said = f"declares {num_classes} classes" if declared else f"has {num_classes} classes in its training labels"
            raise ConfigError(f"the {split} labels of {name} include {high} (sample "
                              f"{int((labels == high).nonzero()[0])}), and {name} {said} (labels 0 to {num_classes - 1})")
        distinct = len(torch.unique(labels))
        if split == "training" and not declared and distinct < high + 1:
            notes.append(f"note: {high + 1} classes inferred from the largest training label ({high}), but only "
                         f"{distinct} distinct labels appear; give the dataset `classes` or `num_classes` to declare them")
    return num_classes, notes


def _declared_classes(dataset) -> bool:
    """Whether the dataset says its number of classes rather than leaving it to be inferred from its labels."""
    if isinstance(getattr(dataset, "num_classes", None), int) or getattr(dataset, "classes", None) is not None:
        return True
    features = getattr(dataset, "features", None)
    if isinstance(features, Mapping) and hasattr(features.get("labels", features.get("label")), "num_classes"):
        return True
    return hasattr(dataset, "dataset") and not hasattr(dataset, "targets") and _declared_classes(dataset.dataset)


def _labels(dataset) -> torch.Tensor | None:
    """A labelled set's class labels where it holds them without reading its samples, else None."""
    if is_stream(dataset):
        return None
    targets = getattr(dataset, "targets", None)
    if targets is None and hasattr(dataset, "tensors"):
        targets = dataset.tensors[-1]
    if targets is None and isinstance(getattr(dataset, "indices", None), (list, range, torch.Tensor)) and \
            hasattr(dataset, "dataset"):  # a Subset
        whole = _labels(dataset.dataset)
        return whole[torch.as_tensor(list(dataset.indices), dtype=torch.long)] if whole is not None else None
    if targets is None:
        return None
    targets = torch.as_tensor(targets)
    return targets if not targets.is_floating_point() and targets.dim() == 1 else None


def _num_classes(dataset) -> int | None:
    """From what datasets usually carry (`num_classes`, `classes`, `targets`, a TensorDataset's labels),
    without reading every sample."""
    if isinstance(getattr(dataset, "num_classes", None), int):
        return dataset.num_classes
    features = getattr(dataset, "features", None)  # a Hugging Face dataset's ClassLabel
    if isinstance(features, Mapping):
        label = features.get("labels", features.get("label"))
        if isinstance(getattr(label, "num_classes", None), int):
            return label.num_classes
    if is_stream(dataset):  # its targets are not held: never read the whole stream for them
        return None
    if getattr(dataset, "classes", None) is not None:
        return len(dataset.classes)
    targets = getattr(dataset, "targets", None)
    if targets is None and hasattr(dataset, "tensors"):
        targets = dataset.tensors[-1]
    if targets is not None and len(targets):
        targets = torch.as_tensor(targets)
        if not targets.is_floating_point():
            return int(targets.max()) + 1
    if hasattr(dataset, "dataset"):  # Subset and similar wrappers
        return _num_classes(dataset.dataset)
    return None


# ------------------------------------------------------------------------------ one sample, all through


def first_samples(dataset, n: int, collate: Callable | None = None, heads: Heads | None = None):
    """The first `n` samples as one batch, collated as the training loader collates them (`heads`: the run's
    first samples of its streams, data.Heads)."""
    if is_stream(dataset):
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
    packing.check_attention(model, job.collate, job.forward, job.data.train, job.model_name)  # packed sets only
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
        return first_samples(job.data.train, 2, job.collate, job.data.heads)
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
